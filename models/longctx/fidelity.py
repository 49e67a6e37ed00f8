"""Attention recall and next-token KL of sparse decoding on the longctx model, in PyTorch, fast
enough to sweep selection settings (sinks, window) on a validation text before the engine's own
`specontext eval` measures the chosen ones on held-out text.

Protocol (as `specontext eval`'s fidelity protocol): a dense prefill of P = context - positions
tokens, then `positions` teacher-forced decode steps under the method; at each step every layer
attends to the selected keys only and the decode tokens' own K/V come from the sparse path.
Recall: the dense softmax mass (this path's q over this path's cache) on the selected keys, mean
over layers and query heads. KL(dense || method) of the next-token distributions.
Selections per KV head, budget B: StreamingLLM keeps `sinks` and the last B - sinks; the oracle
and SpeContext keep `sinks`, the last `window` and the rest by score (oracle: this layer's dense
weights, max over the GQA group; SpeContext: the retrieval head's softmax, max over the group,
one selection for every layer).

    /usr/bin/python3 models/longctx/fidelity.py --text VALIDATION.txt --budgets 128,512,1024 \
        --windows 32,128,256 [--head models/longctx/retrieval_head.safetensors]
"""
import argparse
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", required=True)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--positions", type=int, default=64)
    ap.add_argument("--budgets", default="128,512,1024")
    ap.add_argument("--windows", default="32")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--head", default=os.path.join(HERE, "retrieval_head.safetensors"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    import torch
    sys.path.insert(0, HERE)
    import train as tr
    from export import read_safetensors
    torch.set_num_threads(args.threads)
    st = torch.load(os.path.join(HERE, "ckpt.pt"))
    cfg = st["cfg"]
    model = tr.build_model(cfg)
    model.load_state_dict(st["model"])
    model.eval()
    tok = tr.Tokenizer.load(os.path.join(HERE, "tokenizer.json"))
    with open(args.text, encoding="utf-8") as f:
        ids = [tok.ids["<|endoftext|>"]] + tok.encode(tr.normalize(f.read()))
    N = args.context
    assert len(ids) >= N, f"{args.text}: {len(ids)} tokens, under --context {N}"
    ids = torch.tensor(ids[:N])
    P = N - args.positions
    d, L, H, G = cfg["dim"], cfg["n_layers"], cfg["n_heads"], cfg["n_kv_heads"]
    hd, grp = d // H, H // G
    last = L - 1
    fused_layers = [min(max(i, 0), last) for i in (2, L // 2, L - 3)]
    from forward import apply_rope, decode_layer, dense_layers, rope_tables, top_keep
    cos, sin = rope_tables(cfg, N)  # [N, hd]

    def rope(v, rows):  # v [..., T, hd]
        return apply_rope(v, cos[rows], sin[rows])

    W, meta = read_safetensors(args.head)
    fc, n_in, n_hid = (torch.from_numpy(W[k]) for k in ("fc.weight", "midlayer.input_layernorm.weight",
                                                         "midlayer.hidden_norm.weight"))
    hq, hk = torch.from_numpy(W["midlayer.self_attn.q_proj.weight"]), torch.from_numpy(W["midlayer.self_attn.k_proj.weight"])
    # The head's own query heads (a layers head has one per target layer and KV head) and how
    # selection combines a group's heads: the max of their weights, or turns (GroupReduce::kTurns).
    Hs = hq.shape[0] // hd
    hgrp = Hs // G
    turns = meta.get("select_group", "max") == "turns"
    eps = cfg["norm_eps"]

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def head_qk(tok_ids, fused_prev, rows):
        x = torch.cat([rms(model.tok_embeddings(tok_ids), n_in), rms(fused_prev @ fc.t(), n_hid)], -1)
        q = rope((x @ hq.t()).view(-1, Hs, hd).transpose(0, 1), rows)  # [Hs, T, hd]
        k = rope((x @ hk.t()).view(-1, G, hd).transpose(0, 1), rows)  # [G, T, hd]
        return q, k

    # ---- dense prefill of [0, P): per-layer K/V caches, fused features, head keys ----
    with torch.no_grad():
        rows = torch.arange(P)
        _, Kc, Vc, entering, _ = dense_layers(model, cfg, ids[:P], cos, sin)
        fused = torch.cat([entering[i] for i in fused_layers], -1)
        fused_prev = torch.cat([torch.zeros_like(fused[:1]), fused[:-1]], 0)
        _, HK = head_qk(ids[:P], fused_prev, rows)
        last_fused = fused[-1]

    def run(method, B, window):
        """Decode rows P..N-1 under the method; returns per-step logits and (recall_sum, samples)."""
        K = [k.clone() for k in Kc]
        V = [v.clone() for v in Vc]
        hk_cache = HK.clone()
        prev = last_fused.clone()
        logits, rec, n_rec = [], 0.0, 0
        for t in range(P, N):
            r = torch.tensor([t])
            x = model.tok_embeddings(ids[t:t + 1])
            n = t + 1
            idx = torch.arange(n)
            sel = None
            if method == "streaming":
                keep = (idx < args.sinks) | (idx > t - (B - args.sinks))
                sel = keep[None, :].expand(G, n)
            fixed = (idx < args.sinks) | (idx > t - window)
            if method == "specontext":
                q_h, k_h = head_qk(ids[t:t + 1], prev[None, :], r)
                hk_cache = torch.cat([hk_cache, k_h], 1)
                s = torch.softmax((q_h @ hk_cache.repeat_interleave(hgrp, 0).transpose(-1, -2)).squeeze(1) / math.sqrt(hd), -1)
                free = B - args.sinks - window
                s = by_turns(s.view(G, hgrp, n), fixed, free) if turns else s.view(G, hgrp, n).amax(1)
                sel = top_keep(s, fixed, free)
            if method == "oracle":  # per layer: its own dense weights, max over the GQA group
                def select(dense):
                    return top_keep(dense.view(G, grp, n).amax(1), fixed, B - args.sinks - window)
            elif sel is not None:  # one selection for every layer
                def select(dense):
                    return sel
            else:
                select = None
            ent = []
            for li, layer in enumerate(model.layers):
                ent.append(x)
                x, K[li], V[li], dense, m = decode_layer(layer, cfg, x, K[li], V[li], cos[r], sin[r], select)
                if m is not None:
                    rec += (dense * m).sum().item()
                    n_rec += H
            prev = torch.cat([ent[i] for i in fused_layers], -1)[0]
            logits.append((model.norm(x) @ model.tok_embeddings.weight.t())[0])
        return torch.stack(logits), (rec / n_rec if n_rec else 1.0)

    def by_turns(s, fixed, free):  # s [G, hgrp, n] -> [G, n]: minus each token's best rank over the group
        """GroupReduce::kTurns: each query head ranks the middle tokens (not `fixed`) by its weights,
        older first on ties; a token scores minus its best rank over the group's heads, ranks past the
        `free` slots all minus `free`, and older tokens win the ties (float64: exact for any n here)."""
        n = s.shape[-1]
        idx = torch.arange(n, dtype=torch.float64)
        key = s.double().masked_fill(fixed, float("-inf"))
        order = torch.sort(-key, dim=-1, stable=True).indices  # stable: equal weights keep index order
        rank = torch.empty_like(order)
        rank.scatter_(-1, order, torch.arange(n).expand_as(order).contiguous())
        best = rank.amin(1).clamp_max(max(free, 0)).double()
        return -best * (n + 1) - idx / (n + 1)

    out = {"text": os.path.basename(args.text), "context": N, "positions": args.positions, "sinks": args.sinks,
           "head": os.path.basename(args.head), "rows": []}
    with torch.no_grad():
        dense_logits, _ = run("dense", 0, 0)
        lp_dense = torch.log_softmax(dense_logits, -1)

        def score(method, B, window):
            lg, rec = run(method, B, window)
            lp = torch.log_softmax(lg, -1)
            kl = (lp_dense.exp() * (lp_dense - lp)).sum(-1).mean().item()
            top1 = (lg.argmax(-1) == dense_logits.argmax(-1)).float().mean().item()
            row = {"method": method, "budget": B, "window": window, "recall": rec, "kl": kl, "top1": top1}
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
            return row
        for B in [int(b) for b in args.budgets.split(",")]:
            st_row = score("streaming", B, 0)
            for w in [int(x) for x in args.windows.split(",")]:
                if w + args.sinks >= B:
                    continue
                o_row = score("oracle", B, w)
                s_row = score("specontext", B, w)
                gap = {k: (s_row[k] - st_row[k]) / (o_row[k] - st_row[k]) if o_row[k] != st_row[k] else float("nan")
                       for k in ("recall", "kl")}
                print(f"B {B} window {w}: gap closed recall {gap['recall']:.2f} KL {gap['kl']:.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
