#!/usr/bin/env python3
"""Trains SpeContext's bundled long-context model: a small Llama (GQA, RoPE, SwiGLU, RMSNorm)
that needs its context, on public-domain prose interleaved with RULER-style retrieval tasks.

  /usr/bin/python3 models/longctx/train.py tokenizer   # byte-level BPE on Pride and Prejudice
  /usr/bin/python3 models/longctx/train.py train       # resumes from models/longctx/ckpt.pt
  /usr/bin/python3 models/longctx/train.py temper      # W_q x --alpha for contexts past the windows
  /usr/bin/python3 models/longctx/train.py export      # HF safetensors + GGUF + goldens
  /usr/bin/python3 models/longctx/train.py head        # the retrieval head (distill.py)

Needs Debian's python3-torch, python3-numpy and python3-regex (and, for speed, libopenblas0).
Data: Pride and Prejudice only (public domain); Persuasion is held out for every evaluation
and never read here. The text is data/austen/prideprejudice.txt (see data/SOURCES.md) or --text.

Length: training runs on --len windows whose position ids skip ahead (PoSE, Zhu et al. 2023)
so every relative distance up to --max-pos is seen, then on --long-len windows; RoPE theta is
1e8 so content matching can live on dimensions that barely turn over 8K tokens. README.md has
the commands that made the shipped weights.
"""
import argparse
import json
import math
import os
import random
import struct
import sys
import time

import regex

HERE = os.path.dirname(os.path.abspath(__file__))
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
GPT2_PAT = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


# ---------------------------------------------------------------- text

def normalize(raw):
    """Paragraphs joined by a blank line, the lines of a paragraph by single spaces."""
    paras, cur = [], []
    for line in raw.splitlines():
        s = line.strip()
        if s:
            cur.append(s)
        elif cur:
            paras.append(" ".join(cur))
            cur = []
    if cur:
        paras.append(" ".join(cur))
    return "\n\n".join(paras)


def default_text():
    return os.path.join(HERE, "..", "..", "data", "austen", "prideprejudice.txt")


# ---------------------------------------------------------------- tokenizer

def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


B2U = bytes_to_unicode()


def to_units(s):
    return "".join(B2U[b] for b in s.encode("utf-8"))


def train_bpe(text, vocab_size, extra):
    """Classic GPT-2 BPE training on pre-tokenized word counts. Ties broken by the pair's text."""
    counts = {}
    for chunk, weight in [(text, 1)] + [(e, 50) for e in extra]:
        for w in GPT2_PAT.findall(chunk):
            u = to_units(w)
            counts[u] = counts.get(u, 0) + weight
    words = {w: list(w) for w in counts}
    vocab = [B2U[b] for b in range(256)]
    merges = []
    n_merges = vocab_size - 256 - len(SPECIALS)
    for _ in range(n_merges):
        pairs = {}
        for w, syms in words.items():
            c = counts[w]
            for a, b in zip(syms, syms[1:]):
                pairs[(a, b)] = pairs.get((a, b), 0) + c
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merges.append(best)
        new = best[0] + best[1]
        vocab.append(new)
        for w, syms in words.items():
            if len(syms) < 2:
                continue
            out, i = [], 0
            while i < len(syms):
                if i + 1 < len(syms) and syms[i] == best[0] and syms[i + 1] == best[1]:
                    out.append(new)
                    i += 2
                else:
                    out.append(syms[i])
                    i += 1
            words[w] = out
    vocab += SPECIALS
    return vocab, merges


class Tokenizer:
    def __init__(self, vocab, merges):
        self.vocab = vocab
        self.ids = {t: i for i, t in enumerate(vocab)}
        self.ranks = {tuple(m): i for i, m in enumerate(merges)}
        self.cache = {}
        self.special_re = regex.compile("|".join(regex.escape(s) for s in SPECIALS))
        self.u2b = {u: b for b, u in B2U.items()}

    def _word(self, w):
        if w in self.cache:
            return self.cache[w]
        syms = list(to_units(w))
        while len(syms) > 1:
            best, bi = None, -1
            for i in range(len(syms) - 1):
                r = self.ranks.get((syms[i], syms[i + 1]))
                if r is not None and (best is None or r < best):
                    best, bi = r, i
            if best is None:
                break
            syms[bi:bi + 2] = [syms[bi] + syms[bi + 1]]
        ids = [self.ids[s] for s in syms]
        self.cache[w] = ids
        return ids

    def encode(self, text, special=True):
        out = []
        pos = 0
        parts = []
        if special:
            for m in self.special_re.finditer(text):
                parts.append((text[pos:m.start()], False))
                parts.append((m.group(0), True))
                pos = m.end()
        parts.append((text[pos:], False))
        for s, is_special in parts:
            if is_special:
                out.append(self.ids[s])
            elif s:
                for w in GPT2_PAT.findall(s):
                    out.extend(self._word(w))
        return out

    def decode(self, ids):
        bs = bytearray()
        for i in ids:
            t = self.vocab[i]
            if t in SPECIALS:
                bs += t.encode()
            else:
                bs += bytes(self.u2b[c] for c in t)
        return bs.decode("utf-8", errors="replace")

    @staticmethod
    def load(path):
        with open(path, encoding="utf-8") as f:
            tj = json.load(f)
        n = max(list(tj["model"]["vocab"].values()) + [a["id"] for a in tj["added_tokens"]]) + 1
        vocab = [None] * n
        for t, i in tj["model"]["vocab"].items():
            vocab[i] = t
        for a in tj["added_tokens"]:
            vocab[a["id"]] = a["content"]
        return Tokenizer(vocab, [m.split(" ") for m in tj["model"]["merges"]])


def tokenizer_json(vocab, merges):
    n_base = len(vocab) - len(SPECIALS)
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": n_base + i, "content": s, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}
                         for i, s in enumerate(SPECIALS)],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False,
                  "vocab": {t: i for i, t in enumerate(vocab[:n_base])},
                  "merges": [a + " " + b for a, b in merges]},
    }


# ---------------------------------------------------------------- tasks (RULER-style)
# The exact sentences live here and in the engine's task generator (research eval); the tests
# compare the two through models/longctx/tasks.json.

TEMPLATES = {
    "passkey_needle": " The pass key is {num}. Remember it. {num} is the pass key.",
    "passkey_query": " What is the pass key? The pass key is {num}.",
    "word_needle": " The special magic word for {key} is {val}.",
    "word_query": " What is the special magic word for {key}? The special magic word for {key} is {val}.",
    "multivalue_needle": " One of the special magic words for {key} is {val}.",
    "multivalue_query": " What are all the special magic words for {key}? The special magic words for {key} are {vals}.",
    "code_fact": " The code for {key} is {val}.",
    "code_query": " What is the code for {key}? The code for {key} is {val}.",
    "var_first": " VAR {var} = {num}.",
    "var_next": " VAR {var} = VAR {prev}.",
    "var_query": " Which variables are equal to {num}? The variables equal to {num} are {vars}.",
}
# --distractors: numbers that are not the pass key, placed beside a pass-key needle, so that the
# model learns to copy the number after "The pass key is" and not any number in view (held-out
# prose has years: Persuasion's first pages hold eight).
DISTRACTOR_TEMPLATES = [
    " It was the year {year}.",
    " In {year} they moved to the country.",
    " The sum was {num} pounds.",
    " She had counted {num} of them.",
    " The house was number {num}.",
]
TOOL = {"type": "function", "function": {
    "name": "lookup_code", "description": "Look up the code for a key.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                   "required": ["key"]}}}
SYSTEM = "You are a helpful assistant."


def join_list(xs):
    return xs[0] if len(xs) == 1 else ", ".join(xs[:-1]) + " and " + xs[-1]


def qwen_chat(messages, tools=None):
    """Mirrors the engine's ChatML (Qwen) template: core/tokenizer/tokenizer.cc qwen_chat."""
    out, first = "", 0
    if tools:
        out = "<|im_start|>system\n"
        if messages and messages[0]["role"] == "system":
            out += messages[0]["content"] + "\n\n"
            first = 1
        out += ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
        for t in tools:
            out += "\n" + json.dumps(t)
        out += ("\n</tools>\n\nFor each function call, return a json object with function name and "
                "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n")
    for i in range(first, len(messages)):
        m = messages[i]
        if m["role"] == "tool":
            if i == first or messages[i - 1]["role"] != "tool":
                out += "<|im_start|>user"
            out += "\n<tool_response>\n" + m["content"] + "\n</tool_response>"
            if i + 1 == len(messages) or messages[i + 1]["role"] != "tool":
                out += "<|im_end|>\n"
            continue
        out += "<|im_start|>" + m["role"] + "\n" + m.get("content", "")
        for c, call in enumerate(m.get("tool_calls", [])):
            if c > 0 or m.get("content"):
                out += "\n"
            out += ("<tool_call>\n{\"name\": \"" + call["name"] + "\", \"arguments\": " +
                    json.dumps(call["arguments"]) + "}\n</tool_call>")
        out += "<|im_end|>\n"
    return out


def word_pools(tok, text):
    """Single-token words (' word', 3+ lower-case letters) that occur in the text, split into
    disjoint key / value / variable pools by a fixed rule."""
    present = set(regex.findall(r"[a-z]+", text))
    words = sorted(t[1:] for t in tok.vocab
                   if t.startswith("Ġ") and t[1:].isalpha() and t[1:].islower() and len(t) >= 4
                   and t[1:] in present)
    return {"keys": words[0::3], "values": words[1::3], "vars": [w.upper() for w in words[2::3]]}


class DocBuilder:
    """A token sequence with per-token loss weights: text 1, the assistant's fixed chat text
    (tool-call markup, <|im_end|>) CHAT_W, retrieved answers ANSWER_W (what answer_acc counts)."""
    ANSWER_W = 4.0
    CHAT_W = 2.0
    COPY_W = 3.0

    def __init__(self, tok):
        self.tok = tok
        self.ids, self.w = [], []

    def add(self, text, weight=1.0):
        ids = self.tok.encode(text)
        self.ids += ids
        self.w += [weight] * len(ids)

    def add_ids(self, ids, weight=1.0):
        self.ids += list(ids)
        self.w += [weight] * len(ids)

    def add_templated(self, template, answer_keys, weight_answer, **kw):
        """Adds template.format(**kw), tokenized as one text; the tokens of the last occurrence
        of each field named in answer_keys (with the space before it) get weight_answer."""
        text = template.format(**kw)
        ids = self.tok.encode(text)
        w = [1.0] * len(ids)
        for name in answer_keys:
            at = template.rindex("{" + name + "}")
            prefix = template[:at].format(**kw)
            n0 = len(self.tok.encode(prefix.rstrip(" ")))
            n1 = len(self.tok.encode(prefix + str(kw[name])))
            assert self.tok.encode(prefix + str(kw[name])) == ids[:n1], (template, kw)
            w[n0:n1] = [weight_answer] * (n1 - n0)
        self.ids += ids
        self.w += w


def make_task_events(rng, pools, kind):
    """(needles, queries): needle texts with their answer spec, query texts to place later."""
    K, V, X = pools["keys"], pools["values"], pools["vars"]
    T = TEMPLATES
    if kind == "passkey":
        num = str(rng.randint(10000, 99999))
        needles = [(T["passkey_needle"], (), {"num": num})]
        if DISTRACTORS > 0 and rng.random() < DISTRACTORS:
            for _ in range(rng.randint(1, 4)):
                other = str(rng.randint(10000, 99999))
                if other != num:
                    needles.append((rng.choice(DISTRACTOR_TEMPLATES), (),
                                    {"year": str(rng.randint(1700, 1899)), "num": other}))
            rng.shuffle(needles)
        return needles, [(T["passkey_query"], ("num",), {"num": num})]
    if kind == "multikey":
        n = rng.randint(2, 8)
        keys = rng.sample(K, n)
        vals = [rng.choice(V) for _ in keys]
        needles = [(T["word_needle"], (), {"key": k, "val": v}) for k, v in zip(keys, vals)]
        qi = rng.sample(range(n), rng.randint(1, n))
        return needles, [(T["word_query"], ("val",), {"key": keys[i], "val": vals[i]}) for i in qi]
    if kind == "multivalue":
        key = rng.choice(K)
        vals = rng.sample(V, 4)
        needles = [(T["multivalue_needle"], (), {"key": key, "val": v}) for v in vals]
        others = [k for k in rng.sample(K, 4) if k != key]
        needles += [(T["multivalue_needle"], (), {"key": k, "val": rng.choice(V)}) for k in others[:2]]
        return needles, [(T["multivalue_query"], ("vals",), {"key": key, "vals": join_list(vals)})]
    if kind == "kv":
        n = rng.randint(4, 16)
        keys = rng.sample(K, n)
        vals = [rng.choice(V) for _ in keys]
        needles = [(T["code_fact"], (), {"key": k, "val": v}) for k, v in zip(keys, vals)]
        qi = [rng.randrange(n) for _ in range(rng.randint(n // 2, n))]
        return needles, [(T["code_query"], ("val",), {"key": keys[i], "val": vals[i]}) for i in qi]
    if kind == "vt":
        num = str(rng.randint(10000, 99999))
        vs = rng.sample(X, rng.randint(2, 4))
        needles = [(T["var_first"], (), {"var": vs[0], "num": num})]
        needles += [(T["var_next"], (), {"var": vs[i], "prev": vs[i - 1]}) for i in range(1, len(vs))]
        return needles, [(T["var_query"], ("vars",), {"num": num, "vars": join_list(vs)})]
    raise ValueError(kind)


KINDS = ["passkey", "multikey", "multivalue", "kv", "vt"]
KIND_WEIGHTS = None  # --kind-weights; None draws the kinds uniformly (the stream of the first runs)
DISTRACTORS = 0.0    # --distractors; 0 draws nothing more (the stream of the first runs)


def pick_kind(rng):
    if KIND_WEIGHTS is None:
        return rng.choice(KINDS)
    return rng.choices(KINDS, weights=KIND_WEIGHTS)[0]


def ends_sentence(tok, token_id):
    t = tok.vocab[token_id]
    return t.endswith((".", "!", "?", "Ċ")) or t.endswith('."') or t == '"'


def sentence_boundary(tok, ids, at):
    """The first position >= at that follows the end of a sentence (or the end of ids)."""
    while at < len(ids) and not (at > 0 and ends_sentence(tok, ids[at - 1])):
        at += 1
    return at


def filler_at(rng, filler, n):
    s = rng.randrange(0, len(filler) - n)
    return filler[s:s + n]


def build_doc(rng, tok, filler, pools, length, task_share=0.45):
    """One training sequence: <|endoftext|>, filler with the needles of several tasks placed at
    random points and their queries after them (some at the end). Tasks are added while their
    text stays under ~45% of the window, so at least half of it is prose."""
    events, used = [], 0  # (position fraction, template, answer keys, fields)
    for kind in ["kv"] + [pick_kind(rng) for _ in range(5 if task_share <= 0.5 else 12)]:
        needles, queries = make_task_events(rng, pools, kind)
        # in the order listed: multivalue's answer names its values, vt its chain, in that order
        fracs = sorted(rng.uniform(0.0, 0.7) for _ in needles)
        new = [(f, tpl, (), kw) for f, (tpl, _, kw) in zip(fracs, needles)]
        lo = max(e[0] for e in new)
        new += [(rng.uniform(lo, 1.0) if rng.random() < 0.7 else 1.0, tpl, ans, kw)
                for tpl, ans, kw in queries]
        cost = sum(len(tok.encode(e[1].format(**e[3]))) for e in new)
        if used + cost > task_share * length:
            if events:
                continue
            new = new[:1] + [e for e in new if e[2]][:1]  # one needle and its query at least
            cost = sum(len(tok.encode(e[1].format(**e[3]))) for e in new)
        events += new
        used += cost
    events.sort(key=lambda e: e[0])
    budget = length - 1 - used
    fill = filler_at(rng, filler, budget)
    d = DocBuilder(tok)
    d.add_ids([tok.ids["<|endoftext|>"]], 1.0)
    cut = 0
    for frac, tpl, ans, kw in events:
        at = sentence_boundary(tok, fill, max(cut, min(budget, int(frac * budget))))
        d.add_ids(fill[cut:at])
        cut = at
        d.add_templated(tpl, ans, DocBuilder.ANSWER_W if ans else 1.0, **kw)
    d.add_ids(fill[cut:])
    assert len(d.ids) == length, (len(d.ids), length)
    return d.ids, d.w


def build_copy(rng, tok, length):
    """Random tokens (from an alphabet of 8 to all 1021 ids) with spans of 6-24 copied from
    random earlier points: every copied token after a span's first is an induction target."""
    alpha = rng.sample(range(len(tok.vocab) - len(SPECIALS)), rng.choice([8, 16, 64, 256, 1021]))
    ids, w = [tok.ids["<|endoftext|>"]], [1.0]
    while len(ids) < length:
        if len(ids) > 40 and rng.random() < 0.6:
            n = rng.randint(6, 24)
            at = rng.randrange(1, len(ids) - n)
            ids += ids[at:at + n]
            w += [1.0] + [DocBuilder.COPY_W] * (n - 1)
        else:
            n = rng.randint(4, 30)
            ids += [rng.choice(alpha) for _ in range(n)]
            w += [1.0] * n
    return ids[:length], w[:length]


def build_recall(rng, tok, filler, pools, length):
    """Dense retrieval: the needles of task after task with 0-40 prose tokens between them, and
    their queries asked at random later points (most a few needles later, the rest at the end)."""
    d = DocBuilder(tok)
    d.add_ids([tok.ids["<|endoftext|>"]])
    pending = []
    while len(d.ids) < length:
        if pending and (rng.random() < 0.4 or len(d.ids) > 0.8 * length):
            tpl, ans, kw = pending.pop(rng.randrange(len(pending)))
            d.add_templated(tpl, ans, DocBuilder.ANSWER_W, **kw)
            continue
        needles, queries = make_task_events(rng, pools, pick_kind(rng))
        for tpl, _, kw in needles:
            gap = rng.randint(0, 40)
            if gap:
                d.add_ids(filler_at(rng, filler, gap))
            d.add_templated(tpl, (), 1.0, **kw)
        pending += queries
    return d.ids[:length], d.w[:length]


def build_chat(rng, tok, filler, pools, length):
    """A ChatML conversation: questions about a context, or a tool call and its answer."""
    K, V = pools["keys"], pools["values"]
    d = DocBuilder(tok)
    if rng.random() < 0.5:
        key, val = rng.choice(K), rng.choice(V)
        msgs = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "What is the code for " + key + "?"}]
        prefix = qwen_chat(msgs, tools=[TOOL]) + "<|im_start|>assistant\n"
        d.add(prefix)
        call = "<tool_call>\n{\"name\": \"lookup_code\", \"arguments\": " + json.dumps({"key": key}) + \
            "}\n</tool_call><|im_end|>\n"
        d.add(call, DocBuilder.CHAT_W)
        d.add("<|im_start|>user\n<tool_response>\n" + json.dumps({"code": val}) +
              "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
        d.add_templated("The code for {key} is {val}.", ("val",), DocBuilder.ANSWER_W, key=key, val=val)
        d.add("<|im_end|>\n", DocBuilder.CHAT_W)
    else:
        n = rng.randint(2, 10)
        keys = rng.sample(K, n)
        vals = [rng.choice(V) for _ in keys]
        ctx_budget = max(32, length // 2 - 12 * n)
        fill = filler_at(rng, filler, ctx_budget)
        cuts = sorted(rng.randrange(ctx_budget) for _ in range(n))
        ctx = ""
        prev = 0
        for c, k, v in zip(cuts, keys, vals):
            ctx += tok.decode(fill[prev:c]) + TEMPLATES["code_fact"].format(key=k, val=v)
            prev = c
        ctx += tok.decode(fill[prev:])
        d.add(qwen_chat([{"role": "system", "content": SYSTEM}]))
        d.add("<|im_start|>user\n" + ctx.strip() + "\n\n")
        for turn in range(rng.randint(1, 3)):
            i = rng.randrange(n)
            if turn:
                d.add("<|im_start|>user\n")
            d.add("What is the code for " + keys[i] + "?<|im_end|>\n<|im_start|>assistant\n")
            d.add_templated("The code for {key} is {val}.", ("val",), DocBuilder.ANSWER_W,
                            key=keys[i], val=vals[i])
            d.add("<|im_end|>\n", DocBuilder.CHAT_W)
    ids, w = d.ids[:length], d.w[:length]
    # pad with more prose after an <|endoftext|> so every sequence has `length` tokens
    if len(ids) < length:
        rest = [tok.ids["<|endoftext|>"]] + filler_at(rng, filler, length - len(ids) - 1)
        ids += rest
        w += [1.0] * len(rest)
    return ids, w


# ---------------------------------------------------------------- model

def model_config(vocab_size, max_pos, rope_theta=1e8):
    return dict(vocab_size=vocab_size, dim=128, n_layers=4, n_heads=4, n_kv_heads=2,
                hidden_dim=384, norm_eps=1e-5, rope_theta=rope_theta, max_pos=max_pos)


def plant_induction(model, cfg, c=0.1, s=0.05, amp_prev=4.0, amp_match=2.5, g_prev=0.05,
                    g_copy=0.3, n_match=16):
    """Initialises an induction (copy) circuit in layers 0-1; every weight is then trained.

    Trained from a random start on this machine's budget, the model never formed one: 800 steps
    of copy spans at random offsets left copy accuracy at chance (0.02), and 1,000 task steps left
    key-value answers at chance. So the start is built by hand, as a compiler would:
      residual  dim 0 a constant c (every token), dims 1..63 the token's code, 64..95 free
      layer 0   query head 0 attends to the previous position: its q and k read only the
                constant, on the 4 fastest rotary pairs, phased so the score peaks at offset -1;
                it copies the previous token's code (dims 1..32) into dims 64..95
      layer 1   query head 0 matches the current token's code against each position's
                previous-token code on the n_match slowest rotary dims (which turn < 1 rad over
                8K tokens at theta 1e8), and adds the matched position's own code to dims 1..32,
                which the tied output reads as that token
    Query head 1 of both layers (sharing KV head 0) starts silent. At initialisation this copies
    a repeated random span with accuracy 0.63 at 128 tokens and 0.41 at 1024 (positions offset
    up to 6000)."""
    import torch
    hd = cfg["dim"] // cfg["n_heads"]
    half = hd // 2
    freq = lambda i: cfg["rope_theta"] ** (-2.0 * i / hd)
    with torch.no_grad():
        E = model.tok_embeddings.weight
        E.normal_(0, s)
        E[:, 0] = c
        E[:, 64:] = 0
        L0, L1 = model.layers[0], model.layers[1]
        for L in (L0, L1):
            L.wq.weight[:2 * hd] = 0
            L.wk.weight[:hd] = 0
            L.wv.weight[:hd] = 0
            L.wo.weight[:, :2 * hd] = 0
        for i in range(4):
            L0.wq.weight[i, 0] = amp_prev
            L0.wk.weight[i, 0] = amp_prev * math.cos(freq(i))
            L0.wk.weight[i + half, 0] = amp_prev * math.sin(freq(i))
        for j in range(hd):
            L0.wv.weight[j, 1 + j] = 1.0
            L0.wo.weight[64 + j, j] = g_prev
            L1.wv.weight[j, 1 + j] = 1.0
            L1.wo.weight[1 + j, j] = g_copy
        slow = list(range(half - n_match // 2, half)) + list(range(hd - n_match // 2, hd))
        for j, d in enumerate(slow):
            L1.wq.weight[d, 1 + j] = amp_match
            L1.wk.weight[d, 64 + j] = amp_match


def build_model(cfg):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class RMSNorm(nn.Module):
        def __init__(self, d, eps):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    def rope_tables(pos, d, theta):  # [B,1,T,D] cos and sin, angles in float64
        inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = pos.to(torch.float64)[:, None, :, None] * inv
        ang = torch.cat([ang, ang], -1)
        return ang.cos().float(), ang.sin().float()

    def rope(x, cs):  # x [B, H, T, D], HF rotate_half convention
        cos, sin = cs
        d = x.shape[-1]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            c = cfg
            self.hd = c["dim"] // c["n_heads"]
            self.attention_norm = RMSNorm(c["dim"], c["norm_eps"])
            self.wq = nn.Linear(c["dim"], c["n_heads"] * self.hd, bias=False)
            self.wk = nn.Linear(c["dim"], c["n_kv_heads"] * self.hd, bias=False)
            self.wv = nn.Linear(c["dim"], c["n_kv_heads"] * self.hd, bias=False)
            self.wo = nn.Linear(c["n_heads"] * self.hd, c["dim"], bias=False)
            self.ffn_norm = RMSNorm(c["dim"], c["norm_eps"])
            self.w1 = nn.Linear(c["dim"], c["hidden_dim"], bias=False)
            self.w3 = nn.Linear(c["dim"], c["hidden_dim"], bias=False)
            self.w2 = nn.Linear(c["hidden_dim"], c["dim"], bias=False)

        def forward(self, x, pos, mask):
            B, T, _ = x.shape
            c = cfg
            h = self.attention_norm(x)
            q = self.wq(h).view(B, T, c["n_heads"], self.hd).transpose(1, 2)
            k = self.wk(h).view(B, T, c["n_kv_heads"], self.hd).transpose(1, 2)
            v = self.wv(h).view(B, T, c["n_kv_heads"], self.hd).transpose(1, 2)
            q, k = rope(q, pos), rope(k, pos)
            rep = c["n_heads"] // c["n_kv_heads"]
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
            att = torch.baddbmm(mask, (q * (1.0 / math.sqrt(self.hd))).reshape(B * c["n_heads"], T, -1),
                                k.reshape(B * c["n_heads"], T, -1).transpose(-1, -2)).view(B, c["n_heads"], T, T)
            att = torch.softmax(att, dim=-1)
            o = (att @ v).transpose(1, 2).reshape(B, T, -1)
            x = x + self.wo(o)
            h = self.ffn_norm(x)
            return x + self.w2(F.silu(self.w1(h)) * self.w3(h))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = nn.Embedding(cfg["vocab_size"], cfg["dim"])
            self.layers = nn.ModuleList([Block() for _ in range(cfg["n_layers"])])
            self.norm = RMSNorm(cfg["dim"], cfg["norm_eps"])
            nn.init.normal_(self.tok_embeddings.weight, std=0.02)
            for n, p in self.named_parameters():
                if p.dim() == 2 and "tok_embeddings" not in n:
                    nn.init.normal_(p, std=0.02 / (math.sqrt(2 * cfg["n_layers"]) if n.endswith(("wo.weight", "w2.weight")) else 1))

        def forward(self, ids, pos):
            T = ids.shape[1]
            mask = torch.full((T, T), float("-inf")).triu(1)
            x = self.tok_embeddings(ids)
            pos = rope_tables(pos, cfg["dim"] // cfg["n_heads"], cfg["rope_theta"])
            for layer in self.layers:
                x = layer(x, pos, mask)
            return self.norm(x) @ self.tok_embeddings.weight.t()  # tied output

    return Model()


def pose_positions(rng, n, max_pos):
    """Position ids for n tokens: contiguous chunks with random skips between them (PoSE), the
    last below max_pos. A quarter of the windows start at 0 with no skip."""
    if rng.random() < 0.25 or n >= max_pos:
        return list(range(n))
    chunks = rng.randint(1, 3)
    cuts = sorted(rng.sample(range(1, n), chunks - 1)) if chunks > 1 else []
    spare = max_pos - n
    skips = sorted(rng.randint(0, spare) for _ in range(chunks))
    skips = [skips[0]] + [skips[i] - skips[i - 1] for i in range(1, chunks)]
    pos, p, bounds = [], 0, [0] + cuts + [n]
    for c in range(chunks):
        p += skips[c]
        for _ in range(bounds[c], bounds[c + 1]):
            pos.append(p)
            p += 1
    return pos


# ---------------------------------------------------------------- commands

def load_text(args):
    with open(args.text, encoding="utf-8") as f:
        return normalize(f.read())


def cmd_tokenizer(args):
    text = load_text(args)
    extra = [v.replace("{", "").replace("}", "") for v in TEMPLATES.values()]
    extra.append(qwen_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}],
                           tools=[TOOL]))
    vocab, merges = train_bpe(text, args.vocab, extra)
    tj = tokenizer_json(vocab, merges)
    with open(os.path.join(args.out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tj, f, ensure_ascii=False, indent=1)
    with open(os.path.join(args.out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "add_bos_token": True,
                   "model_max_length": args.max_pos}, f, indent=1)
    tok = Tokenizer(vocab, merges)
    pools = word_pools(tok, text)
    with open(os.path.join(args.out, "tasks.json"), "w", encoding="utf-8") as f:
        json.dump({"templates": TEMPLATES, "tool": TOOL, "system": SYSTEM, **pools}, f, indent=1)
    ids = tok.encode(text)
    print(f"vocab {len(vocab)}, {len(merges)} merges; P&P {len(text)} chars -> {len(ids)} tokens "
          f"({len(text) / len(ids):.2f} chars/token); pools: {len(pools['keys'])} keys, "
          f"{len(pools['values'])} values, {len(pools['vars'])} vars")


def make_batch(rng, tok, filler, pools, batch, length, max_pos, args):
    """Documents drawn by share: --copy-share copy spans, --recall-share dense retrieval,
    --chat-share ChatML, the rest prose with tasks (--task-share of it task sentences)."""
    import torch
    ids, ws, pos = [], [], []
    for _ in range(batch):
        r = rng.random()
        if r < args.copy_share:
            i, w = build_copy(rng, tok, length + 1)
        elif r < args.copy_share + args.recall_share:
            i, w = build_recall(rng, tok, filler, pools, length + 1)
        elif r < args.copy_share + args.recall_share + args.chat_share:
            i, w = build_chat(rng, tok, filler, pools, length + 1)
        else:
            i, w = build_doc(rng, tok, filler, pools, length + 1, args.task_share)
        ids.append(i)
        ws.append(w)
        pos.append(pose_positions(rng, length, max_pos))
    ids = torch.tensor(ids)
    return ids[:, :-1], ids[:, 1:], torch.tensor(ws)[:, 1:], torch.tensor(pos)


def schedule(step, args):
    """(length, batch, lr) for a step: --len windows first, --long-len ones for the last --long-steps
    (and, with --long-every N, on every N-th step before them too)."""
    long = step >= args.steps - args.long_steps or (args.long_every > 0 and step % args.long_every == 0)
    length, batch = (args.long_len, max(1, args.batch * args.len // args.long_len)) if long else (args.len, args.batch)
    warm = 100
    lr = args.lr * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
    return length, batch, lr


def cmd_train(args):
    import torch
    global KIND_WEIGHTS, DISTRACTORS
    DISTRACTORS = args.distractors
    if args.kind_weights:
        KIND_WEIGHTS = [float(x) for x in args.kind_weights.split(",")]
        assert len(KIND_WEIGHTS) == len(KINDS), "--kind-weights needs one weight per kind"
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tok = Tokenizer.load(os.path.join(args.out, "tokenizer.json"))
    text = load_text(args)
    filler = tok.encode(text)
    with open(os.path.join(args.out, "tasks.json"), encoding="utf-8") as f:
        tasks = json.load(f)
    pools = {k: tasks[k] for k in ("keys", "values", "vars")}
    cfg = model_config(len(tok.vocab), args.max_pos, args.rope_theta)
    if args.init:  # fine-tuning an exported candidate: its weights, a fresh optimizer and schedule
        import export
        model, init_cfg = export.read_hf(sys.modules[__name__], args.init)
        assert init_cfg == cfg, f"--init {args.init}: config {init_cfg} is not {cfg}"
    else:
        model = build_model(cfg)
        if args.plant:
            plant_induction(model, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    ckpt = os.path.join(args.out, "ckpt.pt")
    # An HF export does not record its tempering: "unknown" keeps cmd_temper from applying it twice.
    step, attn_scale = 0, ("unknown" if args.init else 1.0)
    if os.path.exists(ckpt):
        st = torch.load(ckpt)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step = st["step"]
        attn_scale = st.get("attn_scale", 1.0)  # a tempered checkpoint trained further stays tempered
        print(f"resumed at step {step}", flush=True)
    print(f"params {sum(p.numel() for p in model.parameters())}", flush=True)
    rng = random.Random(args.seed * 1000003 + step)
    t0, seen, acc = time.time(), 0, []
    while step < args.steps:
        length, batch, lr = schedule(step, args)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y, w, pos = make_batch(rng, tok, filler, pools, batch, length, args.max_pos, args)
        logits = model(x, pos)
        lp = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                               reduction="none").view_as(w)
        loss = (lp * w).sum() / w.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        seen += x.numel()
        hit = logits.argmax(-1) == y
        ans, cp = w == DocBuilder.ANSWER_W, w == DocBuilder.COPY_W
        acc.append(((hit & ans).sum().item(), ans.sum().item(), (hit & cp).sum().item(), cp.sum().item()))
        if step % args.log_every == 0:
            prose = (w == 1.0)  # text, needles and questions
            print(f"step {step} len {length} lr {lr:.2e} loss {loss.item():.3f} "
                  f"prose {(lp * prose).sum().item() / prose.sum().item():.3f} "
                  f"answer_acc {sum(a[0] for a in acc) / max(1, sum(a[1] for a in acc)):.3f} "
                  f"copy_acc {sum(a[2] for a in acc) / max(1, sum(a[3] for a in acc)):.3f} tok/s {seen / (time.time() - t0):.0f}",
                  flush=True)
            acc = []
        if step % args.ckpt_every == 0 or step == args.steps:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                        "cfg": cfg, "attn_scale": attn_scale}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)


def cmd_probe(args):
    """Dense greedy accuracy per task kind on prompts of --probe-len tokens of the *training*
    prose (progress checks while training; the held-out evaluation is `specontext eval --tasks`
    on Persuasion): one task's needles at random depths, its first query at the end."""
    import torch
    global DISTRACTORS
    DISTRACTORS = args.distractors
    torch.set_num_threads(args.threads)
    tok = Tokenizer.load(os.path.join(args.out, "tokenizer.json"))
    filler = tok.encode(load_text(args))
    with open(os.path.join(args.out, "tasks.json"), encoding="utf-8") as f:
        tasks = json.load(f)
    pools = {k: tasks[k] for k in ("keys", "values", "vars")}
    st = torch.load(os.path.join(args.out, "ckpt.pt"))
    model = build_model(st["cfg"])
    model.load_state_dict(st["model"])
    model.eval()
    rng = random.Random(args.seed + 99)
    L = args.probe_len
    for kind in KINDS:
        right = 0
        for _ in range(args.probe_trials):
            needles, queries = make_task_events(rng, pools, kind)
            tpl, ans, kw = queries[0]
            name = ans[0]
            at = tpl.rindex("{" + name + "}")
            prefix = tok.encode(tpl[:at].format(**kw).rstrip(" "))
            answer = tok.encode(tpl[:at].format(**kw) + str(kw[name]))[len(prefix):]
            texts = [tok.encode(t.format(**k)) for t, _, k in needles]
            budget = L - 1 - len(prefix) - len(answer) - sum(len(t) for t in texts)
            fill = filler_at(rng, filler, budget)
            cuts = sorted(sentence_boundary(tok, fill, rng.randrange(budget)) for _ in texts)
            ids, prev = [tok.ids["<|endoftext|>"]], 0
            for c, t in zip(cuts, texts):
                ids += fill[prev:c] + t
                prev = c
            ids += fill[prev:] + prefix
            out = []
            with torch.no_grad():
                for _ in range(len(answer)):
                    x = torch.tensor([ids + out])
                    out.append(int(model(x, torch.arange(x.shape[1])[None])[0, -1].argmax()))
            right += out == answer
        print(f"{kind:10s} len {L}: {right}/{args.probe_trials}", flush=True)


def cmd_temper(args):
    """Sharpens every attention head of the checkpoint for contexts longer than its training
    windows: each layer's W_q is multiplied by --alpha, so every attention logit is (alpha x) its
    trained value, as YaRN's attention scaling does (Peng et al. 2023). Softmax over n keys spreads
    mass by ~log n, so heads trained on 1024-token windows lose their target among 8192 keys; the
    scale restores the margin. Applied once: the checkpoint records it and a second call is refused."""
    import torch
    ckpt = os.path.join(args.out, "ckpt.pt")
    st = torch.load(ckpt)
    if st.get("attn_scale", 1.0) != 1.0:
        sys.exit(f"{ckpt} is already tempered (attn_scale {st['attn_scale']})")
    n = 0
    for name, w in st["model"].items():
        if name.endswith(".wq.weight"):
            w.mul_(args.alpha)
            n += 1
    st["attn_scale"] = args.alpha
    torch.save(st, ckpt + ".tmp")
    os.replace(ckpt + ".tmp", ckpt)
    print(f"{ckpt}: W_q of {n} layers x {args.alpha} (step {st['step']})")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["tokenizer", "train", "probe", "temper", "export", "head"])
    ap.add_argument("--text", default=default_text())
    ap.add_argument("--out", default=HERE)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--max-pos", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--long-steps", type=int, default=150)
    ap.add_argument("--len", type=int, default=512)
    ap.add_argument("--long-len", type=int, default=2048)
    ap.add_argument("--long-every", type=int, default=0,
                    help="also run every N-th step on --long-len windows (0: only the last --long-steps)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--task-share", type=float, default=0.45,
                    help="most of a window the tasks' sentences take (the rest is prose)")
    ap.add_argument("--copy-share", type=float, default=0.2)
    ap.add_argument("--recall-share", type=float, default=0.4)
    ap.add_argument("--chat-share", type=float, default=0.1)
    ap.add_argument("--kind-weights", default="",
                    help="comma-separated draw weights of " + ",".join(KINDS) + " (default: equal)")
    ap.add_argument("--distractors", type=float, default=0.0,
                    help="share of pass-key tasks given 1-4 other numbers (years, sums) as distractors")
    ap.add_argument("--rope-theta", type=float, default=1e8)
    ap.add_argument("--plant", type=int, default=1, help="start from plant_induction (fresh runs)")
    ap.add_argument("--init", default="", help="train: start from this HF export (hf/ dir) when --out has no ckpt.pt")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--probe-len", type=int, default=2048)
    ap.add_argument("--probe-trials", type=int, default=10)
    ap.add_argument("--alpha", type=float, default=2.5, help="temper: the W_q scale")
    ap.add_argument("--head-steps", type=int, default=300)
    ap.add_argument("--head-len", type=int, default=1024)
    ap.add_argument("--head-batch", type=int, default=2)
    ap.add_argument("--head-lr", type=float, default=3e-3)
    ap.add_argument("--head-init", default="", help="head: start from this retrieval head (same shape)")
    ap.add_argument("--head-sinks", type=int, default=4,
                    help="head: first keys left out of the loss (selection keeps them anyway)")
    ap.add_argument("--head-window", type=int, default=32,
                    help="head: most recent keys left out of the loss (selection keeps them anyway)")
    ap.add_argument("--head-weight", choices=["uniform", "far"], default="far",
                    help="head: positions weigh alike, or by the teacher mass on the keys the loss ranks")
    ap.add_argument("--head-weight-floor", type=float, default=0.0,
                    help="head: added to every position's weight (with far: prose positions still count)")
    ap.add_argument("--head-save-every", type=int, default=0,
                    help="head: also write retrieval_head.partial.safetensors every N steps (0 = only at the end)")
    ap.add_argument("--head-answer-weight", type=float, default=1.0,
                    help="head: weight of the positions whose next token is a task's answer (retrieval queries)")
    ap.add_argument("--head-q-per-group", type=int, default=0,
                    help="head: query heads per KV head (0 = the target's); a narrower --head-init is widened")
    ap.add_argument("--head-group-loss", choices=["each", "max", "mix"], default="each",
                    help="head: fit every query head to its group's teacher, or the group's max (as selection ranks), or both (mix)")
    ap.add_argument("--head-teacher", choices=["mean", "layers"], default="mean",
                    help="head: the layers' attention averaged (one map per KV head), or one layer per query "
                         "head of a group (needs --head-q-per-group = layers; selection: the heads in turns)")
    ap.add_argument("--head-mix", type=float, default=0.5,
                    help="head: with --head-group-loss mix, the max loss's weight (the each loss has 1 - this)")
    args = ap.parse_args()
    {"tokenizer": cmd_tokenizer, "train": cmd_train, "probe": cmd_probe, "temper": cmd_temper, "export": lambda a: __import__("export").main(a),
     "head": lambda a: __import__("distill").main(a)}[args.command](args)


if __name__ == "__main__":
    main()
