"""`train.py head`: distils the retrieval head of the long-context model in PyTorch.

Every parameter the pruned EAGLE-3 head keeps is trained: fc [d, 3d], the two RMSNorms, q_proj
and k_proj. The input is EAGLE-3's: x(t) = RMSNorm_in(embed(token_t)) ⊕ RMSNorm_hidden(fc ·
fused(t−1)), fused = the target's residual stream entering layers (2, L/2, L−3) (clamped), zero
at t = 0; q, k get RoPE (rotate_half, the target's theta). Teacher, per KV head g and position t:
the target's attention over keys 0..t, max over the query heads of g (as selection takes it),
averaged over layers and renormalised. Loss: mean over positions and query heads of KL(teacher ‖
softmax(q_h·kᵀ/√head_dim)).

Data: the training documents of train.py (Pride and Prejudice filler with tasks, PoSE positions up
to max_pos) from the first 90% of the novel's tokens; the report uses documents from the last
10%. Persuasion (the evaluation text) is never read. Writes retrieval_head.safetensors in the
layout load_eagle3_head reads, its split in the metadata."""
import hashlib
import json
import math
import os
import random
import struct

import numpy as np


def main(args):
    import torch
    import torch.nn.functional as F
    import train as tr
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed + 1)
    st = torch.load(os.path.join(args.out, "ckpt.pt"))
    cfg = st["cfg"]
    target = tr.build_model(cfg)
    target.load_state_dict(st["model"])
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    tok = tr.Tokenizer.load(os.path.join(args.out, "tokenizer.json"))
    text = tr.load_text(args)
    ids = tok.encode(text)
    split = int(0.9 * len(ids))
    train_fill, held_fill = ids[:split], ids[split:]
    with open(os.path.join(args.out, "tasks.json"), encoding="utf-8") as f:
        tasks = json.load(f)
    pools = {k: tasks[k] for k in ("keys", "values", "vars")}

    d, L = cfg["dim"], cfg["n_layers"]
    H, G = cfg["n_heads"], cfg["n_kv_heads"]
    hd = d // H
    last = L - 1
    fused_layers = [min(max(i, 0), last) for i in (2, L // 2, L - 3)]

    # ---- teacher: attention maps and fused features from the target, by hooks on its blocks ----
    def teacher(x_ids, pos):
        B, T = x_ids.shape
        maps, entering = [], []
        mask = torch.full((T, T), float("-inf")).triu(1)
        x = target.tok_embeddings(x_ids)
        inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        ang = pos.to(torch.float64)[:, None, :, None] * inv
        ang = torch.cat([ang, ang], -1)
        cs = (ang.cos().float(), ang.sin().float())

        def rope(v):
            v1, v2 = v[..., : hd // 2], v[..., hd // 2:]
            return v * cs[0] + torch.cat([-v2, v1], -1) * cs[1]
        for layer in target.layers:
            entering.append(x)
            h = layer.attention_norm(x)
            q = rope(layer.wq(h).view(B, T, H, hd).transpose(1, 2))
            k = rope(layer.wk(h).view(B, T, G, hd).transpose(1, 2)).repeat_interleave(H // G, 1)
            a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, -1)  # [B,H,T,T]
            maps.append(a.view(B, G, H // G, T, T).amax(2))
            x = layer(x, cs, mask)
        t = torch.stack(maps).mean(0)
        t = t / t.sum(-1, keepdim=True)
        fused = torch.cat([entering[i] for i in fused_layers], -1)  # [B,T,3d] at t
        fused_prev = torch.cat([torch.zeros_like(fused[:, :1]), fused[:, :-1]], 1)
        return t, fused_prev, cs

    # ---- student ----
    fc = torch.nn.Parameter(torch.cat([torch.eye(d) / 3] * 3, 1))
    n_in = torch.nn.Parameter(torch.ones(d))
    n_hid = torch.nn.Parameter(torch.ones(d))
    wq = torch.nn.Parameter(torch.randn(H * hd, 2 * d) * 0.02)
    wk = torch.nn.Parameter(torch.randn(G * hd, 2 * d) * 0.02)
    params = [fc, n_in, n_hid, wq, wk]
    if args.head_init:  # warm start from a head of the same shape (e.g. one distilled before a temper)
        with open(args.head_init, "rb") as f:
            raw_init = f.read()
        n_hdr = struct.unpack("<Q", raw_init[:8])[0]
        hdr = json.loads(raw_init[8:8 + n_hdr])
        names = ["fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                 "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight"]
        with torch.no_grad():
            for name, p in zip(names, params):
                s0, s1 = hdr[name]["data_offsets"]
                a = np.frombuffer(raw_init[8 + n_hdr + s0:8 + n_hdr + s1], dtype="<f4").reshape(hdr[name]["shape"])
                assert list(a.shape) == list(p.shape), (name, a.shape, p.shape)
                p.copy_(torch.from_numpy(a.copy()))
    eps = cfg["norm_eps"]

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def student_logp(x_ids, fused_prev, cs):
        B, T = x_ids.shape
        e = rms(target.tok_embeddings(x_ids), n_in)
        h = rms(fused_prev @ fc.t(), n_hid)
        x = torch.cat([e, h], -1)

        def rope(v):
            v1, v2 = v[..., : hd // 2], v[..., hd // 2:]
            return v * cs[0] + torch.cat([-v2, v1], -1) * cs[1]
        q = rope((x @ wq.t()).view(B, T, H, hd).transpose(1, 2))
        k = rope((x @ wk.t()).view(B, T, G, hd).transpose(1, 2)).repeat_interleave(H // G, 1)
        mask = torch.full((T, T), float("-inf")).triu(1)
        return torch.log_softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, -1)  # [B,H,T,T]

    def kl(tch, logp):  # tch [B,G,T,T], logp [B,H,T,T]
        B, _, T, _ = tch.shape
        tg = tch.repeat_interleave(H // G, 1)
        lt = torch.log(tg.clamp_min(1e-30))
        return ((tg * (lt - logp)).masked_fill(tg == 0, 0).sum(-1)).mean()

    def batch(rng, fill, n):
        xs, ps = [], []
        for _ in range(n):
            i, _ = tr.build_doc(rng, tok, fill, pools, args.head_len)
            xs.append(i)
            ps.append(tr.pose_positions(rng, args.head_len, cfg["max_pos"]))
        return torch.tensor(xs), torch.tensor(ps)

    def recall(tch, logp, budgets):
        """Teacher mass on the top-B keys per KV head (max over its group's heads) of the head,
        of StreamingLLM (4 sinks + recent) and of the teacher itself, over positions t >= B."""
        B_, G_, T, _ = tch.shape
        sel = logp.view(B_, G, H // G, T, T).amax(2)
        out = {}
        for b in budgets:
            rows = torch.arange(b, T)
            if len(rows) == 0:
                continue
            tt, ss = tch[:, :, rows], sel[:, :, rows]
            top = ss.topk(b, -1).indices
            head = tt.gather(-1, top).sum(-1).mean().item()
            orc = tt.topk(b, -1).values.sum(-1).mean().item()
            idx = torch.arange(T)
            keep = (idx[None, :] < 4) | (idx[None, :] > rows[:, None] - (b - 4))
            keep &= idx[None, :] <= rows[:, None]
            strm = (tt * keep).sum(-1).mean().item()
            out[b] = {"head": head, "streaming": strm, "oracle": orc}
        return out

    opt = torch.optim.Adam(params, lr=args.head_lr)
    rng = random.Random(args.seed + 7)
    held_rng = random.Random(args.seed + 99)
    with torch.no_grad():
        hx, hp = batch(held_rng, held_fill, 2)
        h_t, h_f, h_cs = teacher(hx, hp)
    budgets = [args.head_len // 64, args.head_len // 16, args.head_len // 8]
    with torch.no_grad():
        before = recall(h_t, student_logp(hx, h_f, h_cs), budgets)
        kl_before = kl(h_t, student_logp(hx, h_f, h_cs)).item()
    for step in range(args.head_steps):
        lr = args.head_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.head_steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        x, p = batch(rng, train_fill, args.head_batch)
        with torch.no_grad():
            t, f, cs = teacher(x, p)
        loss = kl(t, student_logp(x, f, cs))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % 20 == 0:
            print(f"head step {step + 1} kl {loss.item():.4f}", flush=True)
    with torch.no_grad():
        lp = student_logp(hx, h_f, h_cs)
        after = recall(h_t, lp, budgets)
        kl_after = kl(h_t, lp).item()

    tensors = [("fc.weight", fc), ("midlayer.input_layernorm.weight", n_in),
               ("midlayer.hidden_norm.weight", n_hid), ("midlayer.self_attn.q_proj.weight", wq),
               ("midlayer.self_attn.k_proj.weight", wk)]
    kept = sum(p.numel() for _, p in tensors)
    # A full EAGLE-3 draft of this shape: q, k, v, o (2d inputs for q/k/v), an MLP, fc, 4 norms, lm head.
    draft = kept + (G * hd * 2 * d) + (d * H * hd) + 3 * d * cfg["hidden_dim"] + 2 * d + d * cfg["vocab_size"]
    raw = open(args.text, "rb").read()
    sha = hashlib.sha256(raw).hexdigest()
    fnv = 0xcbf29ce484222325
    for byte in raw:
        fnv = ((fnv ^ byte) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    meta = {"format": "specontext-retrieval-head", "hidden": str(d), "n_heads": str(H), "n_kv_heads": str(G),
            "head_dim": str(hd), "rope_theta": "%.17g" % cfg["rope_theta"], "trained_context": str(cfg["max_pos"]),
            "norm_eps": "%.9g" % eps, "fused_layers": ",".join(map(str, fused_layers)),
            "draft_parameters": str(draft), "kept_parameters": str(kept),
            "train_text": os.path.basename(args.text), "train_text_sha256": sha, "train_text_fnv1a64": "%016x" % fnv,
            "train_split": f"tokens [0, {split}) of {len(ids)}; report on [{split}, {len(ids)})"}
    header, off = {}, 0
    arrays = []
    for name, p in tensors:
        a = np.ascontiguousarray(p.detach().float().numpy(), dtype="<f4")
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
        arrays.append(a)
    header["__metadata__"] = meta
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    path = os.path.join(args.out, "retrieval_head.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb)
        for a in arrays:
            f.write(a.tobytes())
    report = {"held_out_kl_before": kl_before, "held_out_kl_after": kl_after,
              "recall_before": before, "recall_after": after, "budgets": budgets,
              "context": args.head_len, "steps": args.head_steps,
              "init": os.path.basename(args.head_init) if args.head_init else "random"}
    with open(os.path.join(args.out, "retrieval_head_report.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))
