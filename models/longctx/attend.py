"""Where a model looks when it answers one task prompt: a dense PyTorch forward of a prompt that
`specontext eval --task-prompts-out FILE` wrote, the greedy answer, and for the answer's first
query, per layer and head, the attention mass on the asked needle and the positions attended most
(with their text), and the mass on every position holding the answer's first token (a wrong
answer copied from several places shows there). For reading why a prompt is missed, not for scoring (the engine scores).

    /usr/bin/python3 models/longctx/attend.py --model models/longctx/candidates/ft2/hf \\
        --prompts /tmp/prompts.jsonl --task kv --depth 0 [--trial 1] [--top 6] [--ablate 256,1024]

With --ablate, also which layer's sparse attention changes the answer's second token (the first
decoded sparsely in `specontext eval`: the prompt's last token is prefilled densely).
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def last_row_attention(model, cfg, ids):
    """Logits of every position and, per layer, the last position's attention [H, T]."""
    import torch
    from forward import dense_layers, rope_tables
    with torch.no_grad():
        cos, sin = rope_tables(cfg, len(ids))
        x, _, _, _, rows = dense_layers(model, cfg, torch.tensor(ids), cos, sin)
        logits = model.norm(x) @ model.tok_embeddings.weight.t()
    return logits, rows


def prefill(model, cfg, ids):
    """The dense prefill of ids[:-1] (per layer K, V) and the RoPE tables of all of ids."""
    import torch
    from forward import dense_layers, rope_tables
    cos, sin = rope_tables(cfg, len(ids))
    with torch.no_grad():
        _, K, V, _, _ = dense_layers(model, cfg, torch.tensor(ids[:-1]), cos, sin)
    return K, V, cos, sin


def oracle_step(model, cfg, ids, pre, budget, sparse_layers, sinks, window):
    """Next-token probabilities of ids' last position when the layers in sparse_layers attend only
    to the per-layer oracle's selection (sinks, the last `window` and the rest by that layer's own
    dense weights, max over the GQA group; the engine's oracle) and the others densely; every
    earlier position is the dense prefill `pre` (prefill(ids)), as in a decode step of `specontext eval`."""
    import torch
    from forward import decode_layer, top_keep
    K, V, cos, sin = pre
    G, grp = cfg["n_kv_heads"], cfg["n_heads"] // cfg["n_kv_heads"]
    n = len(ids)
    idx = torch.arange(n)
    fixed = (idx < sinks) | (idx > n - 1 - window)

    def oracle(dense):
        return top_keep(dense.view(G, grp, n).amax(1), fixed, budget - sinks - window)
    with torch.no_grad():
        x = model.tok_embeddings(torch.tensor(ids[-1:]))
        for li, layer in enumerate(model.layers):
            sparse = li in sparse_layers and budget < n
            x, _, _, _, _ = decode_layer(layer, cfg, x, K[li], V[li], cos[n - 1:n], sin[n - 1:n],
                                         oracle if sparse else None)
        return torch.softmax(model.norm(x) @ model.tok_embeddings.weight.t(), -1)[0]


def print_ablation(model, cfg, tok, ids, budgets, sinks, window):
    """Which layer's sparse attention changes the answer: the oracle at each budget in every layer,
    in one layer alone and in all layers but one (one dense prefill for all of them)."""
    L = cfg["n_layers"]
    pre = prefill(model, cfg, ids)

    def top(pr):
        import torch
        t = torch.topk(pr, 3)
        return ", ".join(f"{tok.decode([int(i)])!r} {float(v):.2f}" for v, i in zip(t.values, t.indices))

    def step(b, layers):
        return top(oracle_step(model, cfg, ids, pre, b, layers, sinks, window))
    print(f"   next token after {tok.decode(ids[-3:])!r}, dense: {step(0, [])}")
    for b in budgets:
        print(f"   oracle B {b}, every layer sparse: {step(b, range(L))}")
        for li in range(L):
            print(f"   oracle B {b}, layer {li} alone sparse: {step(b, [li])} | "
                  f"every layer but {li}: {step(b, [j for j in range(L) if j != li])}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="an HF export directory (config.json, model.safetensors)")
    ap.add_argument("--prompts", required=True, help="JSONL from specontext eval --task-prompts-out")
    ap.add_argument("--task", default="kv")
    ap.add_argument("--length", type=int, default=0, help="0: any")
    ap.add_argument("--depth", type=float, default=0.0)
    ap.add_argument("--trial", type=int, default=-1, help="-1: every trial")
    ap.add_argument("--top", type=int, default=6, help="most attended positions shown per layer and head")
    ap.add_argument("--greedy", type=int, default=1, help="answer tokens decoded (each a full forward)")
    ap.add_argument("--ablate", default="", help="budgets B,..: after the dense answer's first token, "
                    "the next token with the per-layer oracle in every layer, one layer, all but one")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch
    sys.path.insert(0, HERE)
    import train as tr
    torch.set_num_threads(args.threads)
    import export
    model, cfg = export.read_hf(tr, args.model)
    model.eval()
    tok = tr.Tokenizer.load(os.path.join(args.model, "tokenizer.json"))
    for line in open(args.prompts, encoding="utf-8"):
        p = json.loads(line)
        if p["task"] != args.task or abs(p["depth"] - args.depth) > 1e-9 or (args.length and p["length"] != args.length) \
                or (args.trial >= 0 and p["trial"] != args.trial):
            continue
        ids = list(p["tokens"])
        answer = []
        for _ in range(min(args.greedy, p["answer_tokens"])):  # greedy, dense, a full forward each
            logits, rows = last_row_attention(model, cfg, ids + answer)
            if not answer:
                first_rows, first_logits = rows, logits[-1]
            answer.append(int(logits[-1].argmax()))
        n = len(ids)
        at = p["needle_at"]
        needle_end = at
        while needle_end < n and "." not in tok.decode([ids[needle_end]]):
            needle_end += 1
        needle_end += 1
        top5 = torch.topk(torch.softmax(first_logits, -1), 5)
        print(f"== {p['task']} length {p['length']} depth {p['depth']} trial {p['trial']}: {n} tokens, "
              f"want {p['answers']}, dense answer {tok.decode(answer)!r}")
        print(f"   needle [{at}, {needle_end}): {tok.decode(ids[at:needle_end])!r}")
        print("   first answer token: " + ", ".join(f"{tok.decode([int(i)])!r} {float(v):.3f}"
                                                    for v, i in zip(top5.values, top5.indices)))
        same = torch.tensor(ids) == answer[0]  # positions holding the first answer token
        for li, last in enumerate(first_rows):
            for hh in range(last.shape[0]):
                mass = float(last[hh, at:needle_end].sum())
                on_answer = float(last[hh, :n][same].sum())
                top = torch.topk(last[hh], args.top)
                shown = "; ".join(f"{int(i)}:{tok.decode(ids[int(i):int(i) + 1])!r} {float(v):.2f}"
                                  for v, i in zip(top.values, top.indices))
                print(f"   layer {li} head {hh}: needle mass {mass:.3f}, on the answer's token {on_answer:.3f} | {shown}")
        if args.ablate:
            print_ablation(model, cfg, tok, ids + answer[:1], [int(b) for b in args.ablate.split(",")],
                           args.sinks, args.window)


if __name__ == "__main__":
    main()
