#!/usr/bin/env python3
"""Writes tests/data/torch_eagle3/: tiny EAGLE-3 drafts as `pytorch_model.bin` (PyTorch's zip
serialization, written by torch.save itself) and, for each, the same tensors as a safetensors
file written here by hand (so the C++ loader's torch reader is checked against an independent
copy of every byte).

  /usr/bin/python3 tests/data/make_torch_fixtures.py [--out DIR] [--corpus DIR]

--corpus also writes the seeds of tests/fuzz/corpus/fuzz_torch_zip (see tests/fuzz/fuzz_torch_zip.cc:
a first byte 0 for a whole archive, 1 for a data.pkl the fuzzer wraps with storages data/0..3).

Debian's python3-torch (1.13) is the writer: /usr/bin/python3, not a pyenv shim. The shapes fit
tests/core/retrieval_head_test.cc's small_target(): hidden 16, 4 query heads and 2 KV heads of
head_dim 4, draft vocabulary 32, target vocabulary 50 (the MLP is left out to keep files small).

  eagle3_f32.bin   OrderedDict built by hand; q/k/v_proj are views of one [32, 32] storage at
                   offsets 0, 512 and 768 (shared storage, storage_offset); d2t int64, t2d bool
  eagle3_f16.bin   a module's state_dict() in f16 (OrderedDict plus its _metadata, set by BUILD)
  eagle3_bf16.bin  dict(named_parameters()) in bf16 (plain dict, torch._utils._rebuild_parameter)
  *.safetensors    the twin of each .bin: same names, dtypes, shapes and bytes
  strided.bin      fc.weight saved as a transpose (non-contiguous strides): must be refused
  legacy.bin       torch.save(..., _use_new_zipfile_serialization=False): pre-1.6 format, refused
                   (its storage keys are object ids: the only file that differs between runs)
  deflated.bin     eagle3_f16.bin re-zipped with DEFLATE: compressed entries, refused
  evil_global.bin  a STORED archive whose data.pkl calls os.system: a disallowed GLOBAL, refused
                   (written as raw bytes; nothing here unpickles it)
"""
import argparse
import collections
import io
import json
import os
import struct
import zipfile

import torch

D, HEADS, KV_HEADS, HEAD_DIM, DRAFT_VOCAB, TARGET_VOCAB = 16, 4, 2, 4, 32, 50

SAFETENSORS_DTYPE = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.bool: "BOOL",
}


def tensor_bytes(t):
    t = t.detach().contiguous()
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.view(torch.int16)  # numpy has no bf16; the bits are what matter
    return t.numpy().tobytes()


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        b = tensor_bytes(t)
        header[name] = {"dtype": SAFETENSORS_DTYPE[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def draft_tensors(dtype):
    """The EAGLE-3 midlayer tensors the head keeps, some it drops, and the vocabulary maps."""
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: (torch.randn(*shape, generator=g) * 0.2).to(dtype)
    sd = collections.OrderedDict()
    sd["fc.weight"] = r(D, 3 * D)
    sd["midlayer.input_layernorm.weight"] = 1 + r(D)
    sd["midlayer.hidden_norm.weight"] = 1 + r(D)
    qkv = r(HEADS * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM, 2 * D)
    sd["midlayer.self_attn.q_proj.weight"] = qkv[: HEADS * HEAD_DIM]
    sd["midlayer.self_attn.k_proj.weight"] = qkv[HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM]
    sd["midlayer.self_attn.v_proj.weight"] = qkv[(HEADS + KV_HEADS) * HEAD_DIM :]
    sd["midlayer.self_attn.o_proj.weight"] = r(D, HEADS * HEAD_DIM)
    sd["midlayer.post_attention_layernorm.weight"] = 1 + r(D)
    sd["norm.weight"] = 1 + r(D)
    sd["lm_head.weight"] = r(DRAFT_VOCAB, D)
    sd["d2t"] = torch.arange(DRAFT_VOCAB, dtype=torch.int64) * 0  # EAGLE-3: draft→target offsets
    sd["t2d"] = torch.arange(TARGET_VOCAB) < DRAFT_VOCAB
    return sd


class Attn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(2 * D, HEADS * HEAD_DIM, bias=False)
        self.k_proj = torch.nn.Linear(2 * D, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = torch.nn.Linear(2 * D, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = torch.nn.Linear(HEADS * HEAD_DIM, D, bias=False)


class Midlayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = torch.nn.Module()
        self.input_layernorm.weight = torch.nn.Parameter(torch.ones(D))
        self.hidden_norm = torch.nn.Module()
        self.hidden_norm.weight = torch.nn.Parameter(torch.ones(D))
        self.self_attn = Attn()
        self.post_attention_layernorm = torch.nn.Module()
        self.post_attention_layernorm.weight = torch.nn.Parameter(torch.ones(D))


class Draft(torch.nn.Module):
    """EAGLE-3's module tree (names as in its state dict), weights copied from draft_tensors."""

    def __init__(self, dtype):
        super().__init__()
        self.fc = torch.nn.Linear(3 * D, D, bias=False)
        self.midlayer = Midlayer()
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.ones(D))
        self.lm_head = torch.nn.Linear(D, DRAFT_VOCAB, bias=False)
        self.register_buffer("d2t", torch.zeros(DRAFT_VOCAB, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(TARGET_VOCAB, dtype=torch.bool))
        self.to(dtype)
        src = draft_tensors(dtype)
        with torch.no_grad():
            for name, t in self.state_dict().items():
                t.copy_(src[name])


def zip_entry(name, compression):
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))  # fixed: same bytes every run
    info.compress_type = compression
    return info


def rezip(src, dst, compression):
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            zout.writestr(zip_entry(info.filename, compression), zin.read(info.filename))


def write_corpus(out, fixtures):
    """Seeds for fuzz_torch_zip: two whole archives, and pickles whose storages fit data/0..3."""
    os.makedirs(out, exist_ok=True)
    for name in ("eagle3_bf16.bin", "evil_global.bin"):
        with open(os.path.join(fixtures, name), "rb") as f:
            data = f.read()
        with open(os.path.join(out, "archive_" + name.replace(".bin", "")), "wb") as f:
            f.write(b"\x00" + data)
    g = torch.Generator().manual_seed(1)
    base = torch.randn(8, 16, generator=g)
    mixed = collections.OrderedDict()
    mixed["a"] = base[2:6]  # a view at an offset
    mixed["b"] = torch.randn(4, 4, generator=g).half()
    mixed["c"] = torch.randn(3, 1, 5, generator=g).bfloat16()
    mixed["n"] = torch.tensor(7, dtype=torch.int64)  # 0-dim
    params = {"p": torch.nn.Parameter(torch.randn(2, 3, generator=g))}
    for name, obj in (("pickle_views", mixed), ("pickle_parameter", params)):
        buf = io.BytesIO()
        torch.save(obj, buf)
        with zipfile.ZipFile(buf) as z:
            pkl = [n for n in z.namelist() if n.endswith("/data.pkl")][0]
            with open(os.path.join(out, name), "wb") as f:
                f.write(b"\x01" + z.read(pkl))


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(here, "torch_eagle3"))
    ap.add_argument("--corpus", default=None)
    args = ap.parse_args()
    out = args.out
    os.makedirs(out, exist_ok=True)
    p = lambda name: os.path.join(out, name)

    f32 = draft_tensors(torch.float32)
    torch.save(f32, p("eagle3_f32.bin"))
    write_safetensors(p("eagle3_f32.safetensors"), f32)

    f16 = Draft(torch.float16).state_dict()
    torch.save(f16, p("eagle3_f16.bin"))
    write_safetensors(p("eagle3_f16.safetensors"), f16)

    m = Draft(torch.bfloat16)
    bf16 = dict(m.named_parameters())
    torch.save(bf16, p("eagle3_bf16.bin"))
    write_safetensors(p("eagle3_bf16.safetensors"), bf16)

    strided = collections.OrderedDict(f32)
    strided["fc.weight"] = f32["fc.weight"].t().contiguous().t()  # same values, strides (1, 16)
    torch.save(strided, p("strided.bin"))

    torch.save(collections.OrderedDict(fc=f32["fc.weight"]), p("legacy.bin"),
               _use_new_zipfile_serialization=False)

    rezip(p("eagle3_f16.bin"), p("deflated.bin"), zipfile.ZIP_DEFLATED)

    # cos\nsystem\n (GLOBAL os.system), 'true' as its argument, REDUCE, STOP.
    evil = b"\x80\x02cos\nsystem\nq\x00X\x04\x00\x00\x00trueq\x01\x85q\x02Rq\x03."
    with zipfile.ZipFile(p("evil_global.bin"), "w", zipfile.ZIP_STORED) as z:
        z.writestr(zip_entry("evil_global/data.pkl", zipfile.ZIP_STORED), evil)
        z.writestr(zip_entry("evil_global/version", zipfile.ZIP_STORED), b"3\n")

    for name in sorted(os.listdir(out)):
        print(f"{name:26s} {os.path.getsize(p(name)):6d} bytes")
    if args.corpus:
        write_corpus(args.corpus, out)


if __name__ == "__main__":
    main()
