"""`train.py head`: distils the retrieval head of the long-context model in PyTorch.

Every parameter the pruned EAGLE-3 head keeps is trained: fc [d, 3d], the two RMSNorms, q_proj
and k_proj. The input is EAGLE-3's: x(t) = RMSNorm_in(embed(token_t)) ⊕ RMSNorm_hidden(fc ·
fused(t−1)), fused = the target's residual stream entering layers (2, L/2, L−3) (clamped), zero
at t = 0; q, k get RoPE (rotate_half, the target's theta). Teacher, per KV head g and position t:
the target's attention over keys 0..t, max over the query heads of g (as selection takes it),
averaged over layers and renormalised (with --head-teacher layers, query head j of each group
learns layer j's map instead, and selection takes the group's heads in turns: GroupReduce::kTurns,
core/ports/selection.h). Loss: KL(teacher ‖ softmax(q_h·kᵀ/√head_dim)) per query
head and position over the keys selection ranks (past --head-sinks, before the last
--head-window: those are kept anyway), both renormalised there; a position weighs by the teacher
mass on those keys (--head-weight far: positions that look far back count, local ones barely),
times --head-answer-weight where the next token is a task's answer (the retrieval queries). The
report gives each method's recall as the engine selects (budget with sinks and window included),
over all positions and at the answer positions alone.

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
    tr.DISTRACTORS = args.distractors  # the documents' pass-key distractors, as train.py's (0: none)
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
    # The head's own query heads: --head-q-per-group per KV head (default the target's H/G). More
    # than the target's lets the group's heads split the teacher's modes (its layers) among them.
    Hs = G * (args.head_q_per_group or H // G)
    by_layer = args.head_teacher == "layers"
    assert not by_layer or Hs // G == L, "--head-teacher layers needs --head-q-per-group = the target's layers"
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
        per_layer = torch.stack(maps, 2)  # [B,G,L,T,T]
        t = per_layer.mean(2)
        t = t / t.sum(-1, keepdim=True)
        fused = torch.cat([entering[i] for i in fused_layers], -1)  # [B,T,3d] at t
        fused_prev = torch.cat([torch.zeros_like(fused[:, :1]), fused[:, :-1]], 1)
        return (t, per_layer), fused_prev, cs

    # ---- student ----
    fc = torch.nn.Parameter(torch.cat([torch.eye(d) / 3] * 3, 1))
    n_in = torch.nn.Parameter(torch.ones(d))
    n_hid = torch.nn.Parameter(torch.ones(d))
    wq = torch.nn.Parameter(torch.randn(Hs * hd, 2 * d) * 0.02)
    wk = torch.nn.Parameter(torch.randn(G * hd, 2 * d) * 0.02)
    params = [fc, n_in, n_hid, wq, wk]
    if args.head_init:  # warm start from a head of the same shape (e.g. one distilled before a temper)
        from export import read_safetensors
        init, _ = read_safetensors(args.head_init)
        names = ["fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                 "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight"]
        with torch.no_grad():
            for name, p in zip(names, params):
                a = init[name]
                if p is wq and a.shape[0] != p.shape[0]:
                    # A head with fewer query heads per group: each new head copies one of its
                    # group's old heads (in turn), plus noise that breaks their symmetry.
                    old = a.shape[0] // hd // G
                    assert a.shape[0] == G * old * hd and a.shape[1] == p.shape[1], (name, a.shape, p.shape)
                    src = a.reshape(G, old, hd, -1)
                    per = Hs // G
                    new = np.stack([src[:, j % old] for j in range(per)], 1).reshape(Hs * hd, -1)
                    noise = np.random.RandomState(args.seed).randn(*new.shape).astype("f4") * 0.1 * float(np.std(a))
                    a = new + noise
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
        q = rope((x @ wq.t()).view(B, T, Hs, hd).transpose(1, 2))
        k = rope((x @ wk.t()).view(B, T, G, hd).transpose(1, 2)).repeat_interleave(Hs // G, 1)
        mask = torch.full((T, T), float("-inf")).triu(1)
        return torch.log_softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, -1)  # [B,Hs,T,T]

    def ranked_keys(T):
        """[T, T] bool: the keys selection ranks at query t (causal, past the first --head-sinks
        keys and before the last --head-window): the sinks and the window are kept anyway."""
        i = torch.arange(T)
        return (i[None, :] >= args.head_sinks) & (i[None, :] <= i[:, None] - args.head_window)

    def kl(tch, logp, asks=None):  # tch ([B,G,T,T], [B,G,L,T,T]), logp [B,Hs,T,T], asks [B,T] bool
        """Mean over query heads and positions of KL(teacher || head) over the ranked keys, both
        renormalised there; with --head-weight far, each position weighs by the teacher mass it
        puts on those keys (positions that look far back count, local ones barely). With
        --head-group-loss max the student of a KV head is instead its group's max over query heads
        (what selection ranks by), renormalised: one KL per KV head. mix weighs the two:
        (1 - --head-mix) x each + --head-mix x max. With --head-teacher layers, query head j of a
        group against layer j's map ("each")."""
        tch, per_layer = tch
        B, _, T, _ = tch.shape
        if by_layer:
            return kl_of(per_layer.reshape(B, Hs, T, T), logp, asks)
        if args.head_group_loss == "each":
            return kl_of(tch.repeat_interleave(Hs // G, 1), logp, asks)
        lmax = kl_of(tch, logp.view(B, G, Hs // G, T, T).amax(2), asks)
        if args.head_group_loss == "max":
            return lmax
        return (1 - args.head_mix) * kl_of(tch.repeat_interleave(Hs // G, 1), logp, asks) + args.head_mix * lmax

    def kl_of(tg, logp, asks):  # tg [B,H,T,T] teacher, logp [B,H,T,T] its student
        T = tg.shape[-1]
        keep = ranked_keys(T)
        rows = keep.any(-1)
        tg = tg.masked_fill(~keep, 0)
        mass = tg.sum(-1, keepdim=True)  # [B,H,T,1]
        tg = tg / mass.clamp_min(1e-30)
        lp = torch.log_softmax(logp.masked_fill(~keep, float("-inf")), -1)
        lt = torch.log(tg.clamp_min(1e-30))
        per = (tg * (lt - lp)).masked_fill(tg == 0, 0).sum(-1)  # [B,H,T]
        per = per[..., rows]
        w = mass.squeeze(-1)[..., rows] if args.head_weight == "far" else torch.ones_like(per)
        w = w + args.head_weight_floor  # every position counts at least this much (prose positions too)
        if asks is not None and args.head_answer_weight != 1:
            w = w * (1 + (args.head_answer_weight - 1) * asks[:, None, rows].float())
        return (per * w).sum() / w.sum().clamp_min(1e-30)

    def batch(rng, fill, n):
        """n documents as train.py builds them, with PoSE positions, and per position whether the
        next token is an answer (the query positions of retrieval: --head-answer-weight)."""
        xs, ps, qs = [], [], []
        for _ in range(n):
            i, w = tr.build_doc(rng, tok, fill, pools, args.head_len)
            xs.append(i)
            ps.append(tr.pose_positions(rng, args.head_len, cfg["max_pos"]))
            qs.append([wi >= tr.DocBuilder.ANSWER_W for wi in w[1:]] + [False])
        return torch.tensor(xs), torch.tensor(ps), torch.tensor(qs)

    def recall(tch, logp, budgets, asks=None):
        """Teacher mass on the tokens each method keeps per KV head, over positions t >= B, as the
        engine selects them (budget B with --head-sinks sinks and a --head-window window included):
        the head (the rest by its scores, max over the group's heads), the oracle (the rest by the
        teacher's own weights) and StreamingLLM (the sinks and the most recent B - sinks). With
        --head-teacher layers the head's score of a key is minus its best rank over the group's
        heads (the heads take turns), as GroupReduce::kTurns ranks."""
        tch = tch[0]
        B_, G_, T, _ = tch.shape
        S, W = args.head_sinks, args.head_window
        idx = torch.arange(T)
        ranked = ranked_keys(T)
        if by_layer:
            lg = logp.view(B_, G, Hs // G, T, T).masked_fill(~ranked, float("-inf"))
            sel = -lg.argsort(-1, descending=True).argsort(-1).amin(2).float()
        else:
            sel = logp.view(B_, G, Hs // G, T, T).amax(2)
        fixed = ((idx[None, :] < S) | (idx[None, :] > idx[:, None] - W)) & (idx[None, :] <= idx[:, None])
        out = {}
        for b in budgets:
            rows = torch.arange(b, T)
            if len(rows) == 0 or b <= S + W:
                continue
            tt, ss = tch[:, :, rows], sel[:, :, rows]
            base = (tt * fixed[rows]).sum(-1)
            ninf = float("-inf")
            top = ss.masked_fill(~ranked[rows], ninf).topk(b - S - W, -1).indices
            head = base + tt.gather(-1, top).sum(-1)  # [B,G,rows]
            orc = base + tt.masked_fill(~ranked[rows], 0).topk(b - S - W, -1).values.sum(-1)
            keep = (idx[None, :] < S) | (idx[None, :] > rows[:, None] - (b - S))
            keep &= idx[None, :] <= rows[:, None]
            strm = (tt * keep).sum(-1)
            out[b] = {"head": head.mean().item(), "streaming": strm.mean().item(), "oracle": orc.mean().item()}
            if asks is not None and asks[:, rows].any():
                a = asks[:, None, rows].expand_as(head)
                out[b]["at_answers"] = {"head": head[a].mean().item(), "streaming": strm[a].mean().item(),
                                        "oracle": orc[a].mean().item(), "positions": int(asks[:, rows].sum())}
        return out

    def save_head(path):
        """The head as EAGLE-3 safetensors (the names load_eagle3_head reads) with its metadata."""
        tensors = [("fc.weight", fc), ("midlayer.input_layernorm.weight", n_in),
                   ("midlayer.hidden_norm.weight", n_hid), ("midlayer.self_attn.q_proj.weight", wq),
                   ("midlayer.self_attn.k_proj.weight", wk)]
        kept = sum(p.numel() for _, p in tensors)
        # A full EAGLE-3 draft of this shape: q, k, v, o (2d inputs for q/k/v), an MLP, fc, 4 norms, lm head.
        draft = kept + (G * hd * 2 * d) + (d * Hs * hd) + 3 * d * cfg["hidden_dim"] + 2 * d + d * cfg["vocab_size"]
        raw = open(args.text, "rb").read()
        sha = hashlib.sha256(raw).hexdigest()
        fnv = 0xcbf29ce484222325
        for byte in raw:
            fnv = ((fnv ^ byte) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
        meta = {"format": "specontext-retrieval-head", "hidden": str(d), "n_heads": str(Hs), "n_kv_heads": str(G),
                "head_dim": str(hd), "rope_theta": "%.17g" % cfg["rope_theta"], "trained_context": str(cfg["max_pos"]),
                "norm_eps": "%.9g" % eps, "fused_layers": ",".join(map(str, fused_layers)),
                **({"select_group": "turns"} if by_layer else {}),
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
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(hb)) + hb)
            for a in arrays:
                f.write(a.tobytes())
        return meta

    opt = torch.optim.Adam(params, lr=args.head_lr)
    rng = random.Random(args.seed + 7)
    held_rng = random.Random(args.seed + 99)
    with torch.no_grad():
        hx, hp, hq = batch(held_rng, held_fill, 2)
        h_t, h_f, h_cs = teacher(hx, hp)
    budgets = [args.head_len // 64, args.head_len // 16, args.head_len // 8]
    with torch.no_grad():
        before = recall(h_t, student_logp(hx, h_f, h_cs), budgets, hq)
        kl_before = kl(h_t, student_logp(hx, h_f, h_cs), hq).item()
    for step in range(args.head_steps):
        lr = args.head_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.head_steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        x, p, q = batch(rng, train_fill, args.head_batch)
        with torch.no_grad():
            t, f, cs = teacher(x, p)
        loss = kl(t, student_logp(x, f, cs), q)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % 20 == 0:
            print(f"head step {step + 1} kl {loss.item():.4f}", flush=True)
        if args.head_save_every and (step + 1) % args.head_save_every == 0:  # resumable with --head-init
            save_head(os.path.join(args.out, "retrieval_head.partial.safetensors"))
            print(f"head step {step + 1}: saved retrieval_head.partial.safetensors", flush=True)
    with torch.no_grad():
        lp = student_logp(hx, h_f, h_cs)
        after = recall(h_t, lp, budgets, hq)
        kl_after = kl(h_t, lp, hq).item()

    save_head(os.path.join(args.out, "retrieval_head.safetensors"))
    report = {"held_out_kl_before": kl_before, "held_out_kl_after": kl_after,
              "recall_before": before, "recall_after": after, "budgets": budgets,
              "context": args.head_len, "steps": args.head_steps, "lr": args.head_lr,
              "ranked_keys": f"past {args.head_sinks} sinks, before the last {args.head_window}",
              "query_heads": Hs, "teacher": args.head_teacher,
              **({"group_loss": args.head_group_loss} if not by_layer else {"select_group": "turns"}),
              **({"group_loss_mix": args.head_mix} if args.head_group_loss == "mix" else {}),
              **({"distractors": args.distractors} if args.distractors else {}),
              "position_weight": args.head_weight, "position_weight_floor": args.head_weight_floor, "answer_weight": args.head_answer_weight,
              "init": os.path.basename(args.head_init) if args.head_init else "random"}
    with open(os.path.join(args.out, "retrieval_head_report.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))
