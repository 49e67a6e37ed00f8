#!/usr/bin/env python3
"""Writes tests/data/ggml_quants_golden.gguf: for each ggml block type the loader dequantises,
random blocks and the floats an independent implementation decodes them to.

The oracle is llama.cpp's gguf-py (gguf/quants.py, numpy; MIT). It is not part of this
repository and nothing here imports it at build or test time: run this script by hand with
gguf-py on the path (PYTHONPATH=/path/to/llama.cpp/gguf-py), or with --oracle FILE, a module
that defines the classes Q4_0 ... IQ4_XS with gguf-py's dequantize_blocks.

  /usr/bin/python3 tests/data/make_ggml_quants_golden.py [--oracle FILE] [--out PATH]

The file holds, per type T (lower-case name), a tensor "T.blocks" of ggml type T with
n_blocks * block elements and a tensor "T.expected" (F32) of the same element count.
"""
import argparse
import importlib.util
import struct

import numpy as np

# name: (ggml type id, elements per block, bytes per block, byte offsets of f16 scale fields)
TYPES = {
    "q4_0": (2, 32, 18, [0]),
    "q4_1": (3, 32, 20, [0, 2]),
    "q5_0": (6, 32, 22, [0]),
    "q5_1": (7, 32, 24, [0, 2]),
    "q8_0": (8, 32, 34, [0]),
    "q2_k": (10, 256, 84, [80, 82]),
    "q3_k": (11, 256, 110, [108]),
    "q4_k": (12, 256, 144, [0, 2]),
    "q5_k": (13, 256, 176, [0, 2]),
    "q6_k": (14, 256, 210, [208]),
    "iq4_nl": (20, 32, 18, [0]),
    "iq4_xs": (23, 256, 136, [0]),
}
N_BLOCKS = 12


def oracle_classes(path):
    if path:
        spec = importlib.util.spec_from_file_location("oracle", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return {n: getattr(mod, n.upper()) for n in TYPES}
    from gguf import quants  # gguf-py
    return {n: getattr(quants, n.upper()) for n in TYPES}


def random_blocks(rng, n_bytes, f16_offsets):
    blocks = rng.integers(0, 256, size=(N_BLOCKS, n_bytes), dtype=np.uint8)
    # Scales: mostly ordinary magnitudes of both signs, plus the edges a file can hold
    # (zero, a subnormal, a large value).
    special = [0.0, 6e-8, -3.5e-6, 1000.0]
    for b in range(N_BLOCKS):
        for off in f16_offsets:
            if b < len(special) and off == f16_offsets[0]:
                v = special[b]
            else:
                v = float(rng.choice([-1.0, 1.0]) * 10 ** rng.uniform(-4, 0))
            blocks[b, off:off + 2] = np.frombuffer(np.float16(v).tobytes(), dtype=np.uint8)
    return blocks


class GgufWriter:
    """Just enough GGUF v3: string KVs and tensors, 32-byte alignment."""

    def __init__(self):
        self.kv = []
        self.tensors = []

    def add_str(self, key, value):
        self.kv.append((key, value))

    def add_tensor(self, name, ggml_type, n_elements, data):
        self.tensors.append((name, ggml_type, n_elements, bytes(data)))

    def write(self, path):
        def s(x):
            b = x.encode()
            return struct.pack("<Q", len(b)) + b

        out = b"GGUF" + struct.pack("<IQQ", 3, len(self.tensors), len(self.kv))
        for k, v in self.kv:
            out += s(k) + struct.pack("<I", 8) + s(v)
        data = b""
        for name, t, n, payload in self.tensors:
            while len(data) % 32:
                data += b"\0"
            out += s(name) + struct.pack("<I", 1) + struct.pack("<Q", n) + struct.pack("<IQ", t, len(data))
            data += payload
        while len(out) % 32:
            out += b"\0"
        with open(path, "wb") as f:
            f.write(out + data)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--oracle", help="module file with gguf-py's dequantize_blocks classes")
    ap.add_argument("--out", default="tests/data/ggml_quants_golden.gguf")
    ap.add_argument("--seed", type=int, default=20261205)
    args = ap.parse_args()
    classes = oracle_classes(args.oracle)
    rng = np.random.default_rng(args.seed)
    w = GgufWriter()
    w.add_str("general.architecture", "test-vectors")
    w.add_str("general.description", "ggml block dequantisation, decoded by gguf-py quants.py")
    for name, (tid, block, nbytes, f16s) in TYPES.items():
        blocks = random_blocks(rng, nbytes, f16s)
        expected = classes[name].dequantize_blocks(blocks.copy()).astype(np.float32).reshape(-1)
        assert expected.size == N_BLOCKS * block, name
        assert np.all(np.isfinite(expected)), name
        assert np.any(expected != 0), name
        w.add_tensor(name + ".blocks", tid, N_BLOCKS * block, blocks.tobytes())
        w.add_tensor(name + ".expected", 0, N_BLOCKS * block, expected.tobytes())
        print("%-7s %d blocks, max |x| %.4g" % (name, N_BLOCKS, float(np.abs(expected).max())))
    w.write(args.out)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
