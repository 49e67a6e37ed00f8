"""Diagnostic (issue #27): 10 pass-key prompts of 4096 tokens on a text, answered under dense
attention, the per-layer oracle and a shared oracle: one selection per KV head for all layers,
the top keys by the sum over layers of the dense attention of that row (max over the group's query
heads). Sinks 4 and a window of 32 inside the budget B, as the engine selects; the answer rows are
teacher-forced (a prompt counts when every answer token is the argmax). PyTorch, one thread.

    /usr/bin/python3 models/longctx/shared_oracle.py DIR TEXT    # DIR: ckpt.pt, tokenizer.json
"""
import json, math, os, random, sys
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch
import train as tr

CK = sys.argv[1]
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

def forward(ids, rows, mode, sel=None, B=None, collect=None):
    """mode: dense | oracle | shared. rows: sparse query rows. sel[row] -> bool [G, T] (shared)."""
    T = ids.shape[1]
    mask = torch.full((T, T), float("-inf")).triu(1)
    x = model.tok_embeddings(ids)
    pos = tr_rope(torch.arange(T)[None])
    for li, L in enumerate(model.layers):
        h = L.attention_norm(x)
        q = L.wq(h).view(1, T, H, hd).transpose(1, 2)
        k = L.wk(h).view(1, T, G, hd).transpose(1, 2)
        v = L.wv(h).view(1, T, G, hd).transpose(1, 2)
        q, k = rope(q, pos), rope(k, pos)
        k = k.repeat_interleave(rep, 1); v = v.repeat_interleave(rep, 1)
        att = (q[0] / math.sqrt(hd)) @ k[0].transpose(-1, -2) + mask  # [H,T,T]
        if collect is not None:
            p = torch.softmax(att[:, rows], -1)  # [H,R,T]
            collect.append(p.view(G, rep, len(rows), T).amax(1))  # [G,R,T]
        if mode != "dense":
            for ri, r in enumerate(rows):
                if mode == "oracle":
                    p = torch.softmax(att[:, r], -1).view(G, rep, T).amax(1)  # [G,T]
                    keep = choose(p, r, B)
                else:
                    keep = sel[r]
                keepH = keep.repeat_interleave(rep, 0)  # [H,T]
                att[:, r] = att[:, r].masked_fill(~keepH, float("-inf"))
        a = torch.softmax(att, -1)
        o = (a @ v[0]).transpose(0, 1).reshape(1, T, -1)
        x = x + L.wo(o)
        h = L.ffn_norm(x)
        x = x + L.w2(torch.nn.functional.silu(L.w1(h)) * L.w3(h))
    return model.norm(x) @ model.tok_embeddings.weight.t()

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

def tr_rope(pos):
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = pos.to(torch.float64)[:, None, :, None] * inv
    ang = torch.cat([ang, ang], -1)
    return ang.cos().float(), ang.sin().float()

def rope(x, cs):
    cos, sin = cs; d = x.shape[-1]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin

rng = random.Random(7)
res = {m: {b: 0 for b in BUDGETS} for m in ("oracle", "shared")}; dense_ok = 0; n = 0
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
            coll = []
            lg = forward(ids, rows, "dense", collect=coll)
            d_ok = bool((lg[0, rows].argmax(-1) == tgt).all()); dense_ok += d_ok; n += 1
            tot = torch.stack(coll).sum(0)  # [G,R,T] summed over layers
            line = [f"depth {depth} trial {trial} dense {int(d_ok)}"]
            for b in BUDGETS:
                o_ok = bool((forward(ids, rows, "oracle", B=b)[0, rows].argmax(-1) == tgt).all())
                sel = {r: choose(tot[:, ri], r, b) for ri, r in enumerate(rows)}
                s_ok = bool((forward(ids, rows, "shared", sel=sel, B=b)[0, rows].argmax(-1) == tgt).all())
                res["oracle"][b] += o_ok; res["shared"][b] += s_ok
                line.append(f"B{b} o{int(o_ok)} s{int(s_ok)}")
            print(" ".join(line), flush=True)
print("dense", dense_ok / n)
for m in res: print(m, {b: res[m][b] / n for b in BUDGETS})
