"""`train.py export`: writes the trained checkpoint as HF safetensors (hf/) and GGUF
(longctx.gguf), both f32, and the goldens (golden/): a 8192-token document, the PyTorch forward's
logits (float64) at chosen positions, and the greedy answers dense decoding gives on it.

The llama2.c .bin format is not written: its header has no RoPE theta (readers assume 10000)
and no byte-level BPE vocabulary, so it cannot hold this model."""
import json
import os
import random
import shutil
import struct

import numpy as np


def _names(cfg):
    """(checkpoint name, HF name, GGUF name) of every weight, in file order."""
    out = [("tok_embeddings.weight", "model.embed_tokens.weight", "token_embd.weight")]
    for i in range(cfg["n_layers"]):
        p, h, g = f"layers.{i}.", f"model.layers.{i}.", f"blk.{i}."
        out += [(p + ours, h + hf, g + gg) for ours, hf, gg in (
            ("attention_norm.weight", "input_layernorm.weight", "attn_norm.weight"),
            ("wq.weight", "self_attn.q_proj.weight", "attn_q.weight"),
            ("wk.weight", "self_attn.k_proj.weight", "attn_k.weight"),
            ("wv.weight", "self_attn.v_proj.weight", "attn_v.weight"),
            ("wo.weight", "self_attn.o_proj.weight", "attn_output.weight"),
            ("ffn_norm.weight", "post_attention_layernorm.weight", "ffn_norm.weight"),
            ("w1.weight", "mlp.gate_proj.weight", "ffn_gate.weight"),
            ("w3.weight", "mlp.up_proj.weight", "ffn_up.weight"),
            ("w2.weight", "mlp.down_proj.weight", "ffn_down.weight"))]
    out.append(("norm.weight", "model.norm.weight", "output_norm.weight"))
    return out


def _tensors(model, cfg):
    """(HF name, array) and (GGUF name, array) for every weight; q/k rows permuted for GGUF as
    llama.cpp's convert_hf_to_gguf does (its llama RoPE rotates adjacent pairs)."""
    def permute(w, n_head):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    hf, gguf = [], []
    for ours, hname, gname in _names(cfg):
        a = sd[ours]
        hf.append((hname, np.ascontiguousarray(a, dtype=np.float32)))
        if gname.endswith("attn_q.weight"):
            a = permute(a, cfg["n_heads"])
        elif gname.endswith("attn_k.weight"):
            a = permute(a, cfg["n_kv_heads"])
        gguf.append((gname, np.ascontiguousarray(a, dtype=np.float32)))
    return hf, gguf


def read_hf(tr, hf_dir):
    """(model, cfg) of an HF export written by main(): config.json and model.safetensors, f32, the
    names of _tensors read back (no q/k permutation: the HF tensors are the checkpoint's)."""
    import torch
    c = json.load(open(os.path.join(hf_dir, "config.json")))
    cfg = tr.model_config(c["vocab_size"], c["max_position_embeddings"], c["rope_theta"])
    got = (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"],
           c["intermediate_size"], c["rms_norm_eps"])
    want = (cfg["dim"], cfg["n_layers"], cfg["n_heads"], cfg["n_kv_heads"], cfg["hidden_dim"], cfg["norm_eps"])
    assert got == want, f"{hf_dir}: shape {got} is not train.py's {want}"
    tensors, _ = read_safetensors(os.path.join(hf_dir, "model.safetensors"))
    model = tr.build_model(cfg)
    sd = {ours: torch.from_numpy(tensors[theirs]) for ours, theirs, _ in _names(cfg)}
    model.load_state_dict(sd)
    return model, cfg


def read_safetensors(path):
    """({name: float32 array}, __metadata__) of an f32 safetensors file (what write_safetensors
    writes: the exports and the retrieval heads)."""
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    hdr = json.loads(raw[8:8 + n])
    out = {}
    for name, e in hdr.items():
        if name == "__metadata__":
            continue
        assert e["dtype"] == "F32", f"{path}: {name} is {e['dtype']} (only f32 files are read)"
        s0, s1 = e["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + s0:8 + n + s1], dtype="<f4").reshape(e["shape"]).copy()
    return out, hdr.get("__metadata__", {})


def write_safetensors(path, tensors):
    header, off = {}, 0
    for name, a in tensors:
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for _, a in tensors:
            f.write(a.tobytes())


def write_gguf(path, kv, tensors, alignment=32):
    """GGUF v3, little-endian; kv values: str, int (u32), float (f32), bool, [str], [int (i32)]."""
    def s(x):
        b = x.encode("utf-8")
        return struct.pack("<Q", len(b)) + b

    def value(v):
        if isinstance(v, bool):
            return struct.pack("<I", 7) + struct.pack("<?", v)
        if isinstance(v, int):
            return struct.pack("<I", 4) + struct.pack("<I", v)
        if isinstance(v, float):
            return struct.pack("<I", 6) + struct.pack("<f", v)
        if isinstance(v, str):
            return struct.pack("<I", 8) + s(v)
        if isinstance(v, list) and all(isinstance(e, str) for e in v):
            return struct.pack("<I", 9) + struct.pack("<IQ", 8, len(v)) + b"".join(s(e) for e in v)
        if isinstance(v, list):
            return struct.pack("<I", 9) + struct.pack("<IQ", 5, len(v)) + b"".join(struct.pack("<i", e) for e in v)
        raise TypeError(type(v))

    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv)))
    for k, v in kv.items():
        out += s(k) + value(v)
    off = 0
    for name, a in tensors:
        out += s(name) + struct.pack("<I", a.ndim) + b"".join(struct.pack("<Q", d) for d in reversed(a.shape))
        out += struct.pack("<IQ", 0, off)  # type 0 = F32
        off += a.nbytes + (-a.nbytes % alignment)
    out += b"\0" * (-len(out) % alignment)
    for _, a in tensors:
        out += a.tobytes() + b"\0" * (-a.nbytes % alignment)
    with open(path, "wb") as f:
        f.write(out)


def golden_doc(tr, tok, filler, pools, length, seed):
    rng = random.Random(seed)
    ids, _ = tr.build_doc(rng, tok, filler, pools, length)
    return ids


def main(args):
    import torch
    import train as tr
    torch.set_num_threads(args.threads)
    st = torch.load(os.path.join(args.out, "ckpt.pt"))
    cfg = st["cfg"]
    model = tr.build_model(cfg)
    model.load_state_dict(st["model"])
    model.eval()
    tok = tr.Tokenizer.load(os.path.join(args.out, "tokenizer.json"))
    hf_dir = os.path.join(args.out, "hf")
    os.makedirs(hf_dir, exist_ok=True)
    hf, gguf = _tensors(model, cfg)
    eot, im_end = tok.ids["<|endoftext|>"], tok.ids["<|im_end|>"]
    write_safetensors(os.path.join(hf_dir, "model.safetensors"), hf)
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                   "hidden_size": cfg["dim"], "intermediate_size": cfg["hidden_dim"],
                   "num_hidden_layers": cfg["n_layers"], "num_attention_heads": cfg["n_heads"],
                   "num_key_value_heads": cfg["n_kv_heads"], "head_dim": cfg["dim"] // cfg["n_heads"],
                   "rms_norm_eps": cfg["norm_eps"], "rope_theta": cfg["rope_theta"],
                   "max_position_embeddings": cfg["max_pos"], "vocab_size": cfg["vocab_size"],
                   "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False,
                   "bos_token_id": eot, "eos_token_id": im_end, "torch_dtype": "float32"}, f, indent=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(args.out, name), os.path.join(hf_dir, name))

    n_base = len(tok.vocab) - len(tr.SPECIALS)
    with open(os.path.join(args.out, "tokenizer.json"), encoding="utf-8") as f:
        merges = json.load(f)["model"]["merges"]
    kv = {
        "general.architecture": "llama", "general.name": "specontext-longctx",
        "general.alignment": 32,
        "llama.context_length": cfg["max_pos"], "llama.embedding_length": cfg["dim"],
        "llama.block_count": cfg["n_layers"], "llama.feed_forward_length": cfg["hidden_dim"],
        "llama.attention.head_count": cfg["n_heads"], "llama.attention.head_count_kv": cfg["n_kv_heads"],
        "llama.rope.dimension_count": cfg["dim"] // cfg["n_heads"],
        "llama.rope.freq_base": float(cfg["rope_theta"]),
        "llama.attention.layer_norm_rms_epsilon": float(cfg["norm_eps"]),
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tok.vocab,
        "tokenizer.ggml.token_type": [1] * n_base + [3] * len(tr.SPECIALS),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": eot, "tokenizer.ggml.eos_token_id": im_end,
        "tokenizer.ggml.add_bos_token": True,
    }
    write_gguf(os.path.join(args.out, "longctx.gguf"), kv, gguf)

    # Goldens: one document of max_pos tokens (Pride and Prejudice filler: the training text,
    # so the held-out split stays untouched), logits of a float64 forward at chosen positions.
    gdir = os.path.join(args.out, "golden")
    os.makedirs(gdir, exist_ok=True)
    text = tr.load_text(args)
    filler = tok.encode(text)
    with open(os.path.join(args.out, "tasks.json"), encoding="utf-8") as f:
        tasks = json.load(f)
    pools = {k: tasks[k] for k in ("keys", "values", "vars")}
    n = cfg["max_pos"]
    ids = golden_doc(tr, tok, filler, pools, n, seed=20261205)
    positions = [0, 1, 2, 63, 511, 1024, 2047, 4095, 4096, 6000, n - 2, n - 1]
    m64 = tr.build_model(cfg).double()
    m64.load_state_dict({k: v.double() for k, v in st["model"].items()})
    m64.eval()
    with torch.no_grad():
        logits = m64(torch.tensor([ids]), torch.arange(n)[None])[0]
    sel = logits[positions].float().numpy()
    np.asarray(ids, dtype="<i4").tofile(os.path.join(gdir, "ids_i32le.bin"))
    sel.astype("<f4").tofile(os.path.join(gdir, "logits_f32le.bin"))
    with open(os.path.join(gdir, "golden.json"), "w") as f:
        json.dump({"n_tokens": n, "positions": positions, "vocab_size": cfg["vocab_size"],
                   "logits": "logits_f32le.bin: float32 [positions][vocab], a float64 PyTorch forward",
                   "ids": "ids_i32le.bin: int32 token ids (BOS first), positions 0..n-1",
                   "seed": 20261205, "text": "train.py build_doc on Pride and Prejudice filler"}, f, indent=1)
    # Tokenizer goldens: prose, a task, and a chat with a tool call (special tokens parsed).
    samples = [text[:2000], text[len(text) // 2: len(text) // 2 + 1500],
               tr.TEMPLATES["var_query"].format(num="12345", vars="AUNT, ARE and ALWAYS"),
               tr.qwen_chat([{"role": "system", "content": tr.SYSTEM},
                             {"role": "user", "content": "What is the code for river?"},
                             {"role": "assistant", "content": "",
                              "tool_calls": [{"name": "lookup_code", "arguments": {"key": "river"}}]},
                             {"role": "tool", "content": "{\"code\": \"lady\"}"}], tools=[tr.TOOL]),
               "Numbers 1234567, unicode caf\u00e9 \u2014 and  spaces\n\n\tend."]
    with open(os.path.join(gdir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump([{"text": t, "ids": tok.encode(t)} for t in samples], f, ensure_ascii=False)
    print(f"wrote hf/, longctx.gguf, golden/ ({len(positions)} positions of {n})")
