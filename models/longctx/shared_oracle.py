"""Diagnostic (issue #27): 10 pass-key prompts of 4096 tokens on a text, answered under dense
attention, the per-layer oracle and shared oracles: one selection per KV head for all layers,
made from the dense attention of that row (max over the group's query heads) of every layer by a
rule: `sum` (top keys by the sum over layers), `max` (by the max over layers) or `union` (the
layers take turns: each adds its best key not yet kept until B). Sinks 4 and a window of 32 inside the budget B, as the engine selects; the answer rows are
teacher-forced (a prompt counts when every answer token is the argmax). PyTorch, one thread.

    /usr/bin/python3 models/longctx/shared_oracle.py DIR TEXT [RULES]   # DIR: ckpt.pt, tokenizer.json
                                                                        # RULES: sum,max,union (sum)
"""
import json, math, os, random, sys
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch
import train as tr

CK = sys.argv[1]
RULES = (sys.argv[3] if len(sys.argv) > 3 else "sum").split(",")
BUDGETS = [64, 128, 256, 512, 1024]
torch.set_num_threads(1)
st = torch.load(CK + "/ckpt.pt")
cfg = st["cfg"]
model = tr.build_model(cfg); model.load_state_dict(st["model"]); model.eval()
tok = tr.Tokenizer.load(CK + "/tokenizer.json")
T_ = json.load(open(os.path.join(HERE, "tasks.json")))["templates"]
filler = tok.encode(open(sys.argv[2]).read())
H, G = cfg["n_heads"], cfg["n_kv_heads"]; rep = H // G; hd = cfg["dim"] // H
S, W = 4, 32

def prefix_cache(ids, r0):
    """Dense pass over positions < r0 (the same under every method): each layer's K and V there,
    GQA-expanded, roped. [H, r0, hd] per layer."""
    T = r0
    mask = torch.full((T, T), float("-inf")).triu(1)
    x = model.tok_embeddings(ids[:, :T])
    pos = tr_rope(torch.arange(T)[None])
    cache = []
    for L in model.layers:
        h = L.attention_norm(x)
        q = rope(L.wq(h).view(1, T, H, hd).transpose(1, 2), pos)
        k = rope(L.wk(h).view(1, T, G, hd).transpose(1, 2), pos).repeat_interleave(rep, 1)[0]
        v = L.wv(h).view(1, T, G, hd).transpose(1, 2).repeat_interleave(rep, 1)[0]
        cache.append((k, v))
        a = torch.softmax((q[0] / math.sqrt(hd)) @ k.transpose(-1, -2) + mask, -1)
        x = x + L.wo((a @ v).transpose(0, 1).reshape(1, T, -1))
        h = L.ffn_norm(x)
        x = x + L.w2(torch.nn.functional.silu(L.w1(h)) * L.w3(h))
    return cache

def forward(ids, rows, cache, mode, sel=None, B=None, collect=None):
    """Logits of the query rows (contiguous, the last of ids) over the cached prefix and
    themselves. mode: dense | oracle | shared; sel[row] -> bool [G, row+1] (shared)."""
    r0, R = rows[0], len(rows)
    T = r0 + R
    mask = torch.zeros(R, T); mask[:, r0:] = torch.full((R, R), float("-inf")).triu(1)
    x = model.tok_embeddings(ids[:, r0:T])
    pos = tr_rope(torch.arange(r0, T)[None])
    for L, (kc, vc) in zip(model.layers, cache):
        h = L.attention_norm(x)
        q = rope(L.wq(h).view(1, R, H, hd).transpose(1, 2), pos)[0]
        k = torch.cat([kc, rope(L.wk(h).view(1, R, G, hd).transpose(1, 2), pos).repeat_interleave(rep, 1)[0]], 1)
        v = torch.cat([vc, L.wv(h).view(1, R, G, hd).transpose(1, 2).repeat_interleave(rep, 1)[0]], 1)
        att = (q / math.sqrt(hd)) @ k.transpose(-1, -2) + mask  # [H,R,T]
        if collect is not None:
            collect.append(torch.softmax(att, -1).view(G, rep, R, T).amax(1))  # [G,R,T]
        if mode != "dense":
            for ri, r in enumerate(rows):
                if mode == "oracle":
                    keep = choose(torch.softmax(att[:, ri], -1).view(G, rep, T).amax(1), r, B)
                else:
                    keep = sel[r]
                att[:, ri] = att[:, ri].masked_fill(~keep.repeat_interleave(rep, 0), float("-inf"))
        o = (torch.softmax(att, -1) @ v).transpose(0, 1).reshape(1, R, -1)
        x = x + L.wo(o)
        h = L.ffn_norm(x)
        x = x + L.w2(torch.nn.functional.silu(L.w1(h)) * L.w3(h))
    return model.norm(x) @ model.tok_embeddings.weight.t()  # [1,R,V]

def choose(score, r, B):  # score [G,T] over keys 0..r
    T = score.shape[1]
    keep = torch.zeros(G, T, dtype=torch.bool)
    fixed = torch.zeros(T, dtype=torch.bool); fixed[:S] = True; fixed[max(0, r - W + 1):r + 1] = True
    fixed[r + 1:] = False
    keep |= fixed
    free = B - int(fixed.sum())
    s = score.clone(); s[:, r + 1:] = -1; s[:, fixed] = -1
    if free > 0:
        idx = s.topk(free, -1).indices
        keep.scatter_(1, idx, True)
    keep[:, r + 1:] = False
    return keep

def choose_union(per_layer, r, B):  # per_layer [L,G,T]: the layers take turns
    L_, _, T = per_layer.shape
    keep = choose(per_layer[0], r, 0)  # the sinks and the window
    free = B - int(keep[0].sum())
    if free <= 0: return keep
    s = per_layer.clone(); s[:, :, r + 1:] = -1; s[:, keep] = -1
    order = s.argsort(-1, descending=True)  # [L,G,T]
    for g in range(G):
        got, cursor = 0, [0] * L_
        while got < free:
            for l in range(L_):
                while got < free and cursor[l] < T:
                    t = int(order[l, g, cursor[l]]); cursor[l] += 1
                    if t <= r and not keep[g, t]:
                        keep[g, t] = True; got += 1; break
            if all(c >= T for c in cursor): break
    return keep

def shared_selection(rule, per_layer, ri, r, B):  # per_layer [L,G,R,T]
    if rule == "sum": return choose(per_layer[:, :, ri].sum(0), r, B)
    if rule == "max": return choose(per_layer[:, :, ri].amax(0), r, B)
    return choose_union(per_layer[:, :, ri], r, B)

def tr_rope(pos):
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = pos.to(torch.float64)[:, None, :, None] * inv
    ang = torch.cat([ang, ang], -1)
    return ang.cos().float(), ang.sin().float()

def rope(x, cs):
    cos, sin = cs; d = x.shape[-1]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin

rng = random.Random(7)
res = {m: {b: 0 for b in BUDGETS} for m in ["oracle"] + RULES}; dense_ok = 0; n = 0
with torch.no_grad():
    for depth in [0, 0.25, 0.5, 0.75, 1.0]:
        for trial in range(2):
            num = str(rng.randint(10000, 99999))
            needle = tok.encode(T_["passkey_needle"].format(num=num))
            qtpl = T_["passkey_query"]; at = qtpl.rindex("{num}")
            question = tok.encode(qtpl[:at].format(num=num).rstrip(" "))
            answer = tok.encode(qtpl[:at].format(num=num) + num)[len(question):]
            budget = 4096 - 1 - len(needle) - len(question)
            s0 = rng.randrange(0, len(filler) - budget); fill = filler[s0:s0 + budget]
            cut = tr.sentence_boundary(tok, fill, int(depth * budget))
            prompt = [tok.ids["<|endoftext|>"]] + fill[:cut] + needle + fill[cut:] + question
            seq = prompt + answer
            ids = torch.tensor([seq[:-1]])
            rows = list(range(len(prompt) - 1, len(seq) - 1))
            tgt = torch.tensor(answer)
            cache = prefix_cache(ids, rows[0])
            coll = []
            lg = forward(ids, rows, cache, "dense", collect=coll)
            d_ok = bool((lg[0].argmax(-1) == tgt).all()); dense_ok += d_ok; n += 1
            per_layer = torch.stack(coll)  # [L,G,R,T]
            line = [f"depth {depth} trial {trial} dense {int(d_ok)}"]
            for b in BUDGETS:
                o_ok = bool((forward(ids, rows, cache, "oracle", B=b)[0].argmax(-1) == tgt).all())
                res["oracle"][b] += o_ok
                line.append(f"B{b} o{int(o_ok)}")
                for rule in RULES:
                    sel = {r: shared_selection(rule, per_layer, ri, r, b) for ri, r in enumerate(rows)}
                    s_ok = bool((forward(ids, rows, cache, "shared", sel=sel, B=b)[0].argmax(-1) == tgt).all())
                    res[rule][b] += s_ok
                    line.append(f"{rule[0]}{int(s_ok)}")
            print(" ".join(line), flush=True)
print("dense", dense_ok / n)
for m in res: print(m, {b: res[m][b] / n for b in BUDGETS})
