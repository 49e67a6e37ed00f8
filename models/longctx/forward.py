"""The longctx model's forward in the pieces the analysis scripts need: a dense prefill that keeps,
per layer, the K/V cache (after RoPE), the residual stream entering it and the last position's
attention weights; and one layer of a one-token decode step whose attention a selection can
restrict. fidelity.py (prefill and sparse decode) and attend.py (where an answer looks, which
layer's sparse attention changes it) share them."""
import math


def rope_tables(cfg, n):
    """cos, sin [n, head_dim] of positions 0..n-1 (rotate_half, the model's theta; angles in float64)."""
    import torch
    hd = cfg["dim"] // cfg["n_heads"]
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv
    ang = torch.cat([ang, ang], -1)
    return ang.cos().float(), ang.sin().float()


def apply_rope(v, cos, sin):
    """v [..., T, hd] rotated by the tables' rows for its T positions."""
    import torch
    hd = v.shape[-1]
    v1, v2 = v[..., : hd // 2], v[..., hd // 2:]
    return v * cos + torch.cat([-v2, v1], -1) * sin


def dense_layers(model, cfg, ids, cos, sin):
    """Causal dense forward of ids [T] (positions 0..T-1, tables' first T rows), one head at a time
    ([T, T] scores). Returns (x, K, V, entering, last_rows): the final residual [T, d], per layer K and
    V [G, T, hd], the residual entering it [T, d] and the last position's attention [H, T]."""
    import torch
    T = ids.shape[0]
    H, G = cfg["n_heads"], cfg["n_kv_heads"]
    hd, grp = cfg["dim"] // H, H // G
    c, s = cos[:T], sin[:T]
    K, V, entering, last_rows = [], [], [], []
    x = model.tok_embeddings(ids)
    mask = torch.full((T, T), float("-inf")).triu(1)
    for layer in model.layers:
        entering.append(x)
        h = layer.attention_norm(x)
        q = apply_rope(layer.wq(h).view(T, H, hd).transpose(0, 1), c, s)
        k = apply_rope(layer.wk(h).view(T, G, hd).transpose(0, 1), c, s)
        v = layer.wv(h).view(T, G, hd).transpose(0, 1)
        K.append(k)
        V.append(v)
        o = torch.empty(H, T, hd)
        last = torch.empty(H, T)
        for hh in range(H):
            a = torch.softmax(q[hh] @ k[hh // grp].t() / math.sqrt(hd) + mask, -1)
            o[hh] = a @ v[hh // grp]
            last[hh] = a[-1]
        last_rows.append(last)
        x = x + layer.wo(o.transpose(0, 1).reshape(T, -1))
        hf = layer.ffn_norm(x)
        x = x + layer.w2(torch.nn.functional.silu(layer.w1(hf)) * layer.w3(hf))
    return x, K, V, entering, last_rows


def top_keep(scores, fixed, k):
    """[G, n] bool: the `fixed` tokens [n] and, per row of scores [G, n], the k best of the others."""
    keep = fixed[None, :].expand_as(scores).clone()
    if k > 0:
        s = scores.masked_fill(fixed[None, :], float("-inf"))
        keep.scatter_(1, s.topk(min(k, int((~fixed).sum())), -1).indices, True)
    return keep


def decode_layer(layer, cfg, x, K, V, cos_r, sin_r, select=None):
    """One layer of a one-token decode step: x [1, d] at the position of the tables' rows cos_r,
    sin_r [1, hd]; the token's K/V are appended to K, V [G, n-1, hd]. select(dense [H, n]) gives the
    keys each KV head attends to ([G, n] bool) or None for all of them. Returns (x, K, V, dense, m):
    the layer's output, the caches, the dense weights and the per-query-head mask (None if dense)."""
    import torch
    H, G = cfg["n_heads"], cfg["n_kv_heads"]
    hd, grp = cfg["dim"] // H, H // G
    h = layer.attention_norm(x)
    q = apply_rope(layer.wq(h).view(1, H, hd).transpose(0, 1), cos_r, sin_r)  # [H, 1, hd]
    K = torch.cat([K, apply_rope(layer.wk(h).view(1, G, hd).transpose(0, 1), cos_r, sin_r)], 1)
    V = torch.cat([V, layer.wv(h).view(1, G, hd).transpose(0, 1)], 1)
    logit = (q @ K.repeat_interleave(grp, 0).transpose(-1, -2)).squeeze(1) / math.sqrt(hd)  # [H, n]
    dense = torch.softmax(logit, -1)
    keep = select(dense) if select else None
    m = None if keep is None else keep.repeat_interleave(grp, 0)
    a = dense if m is None else torch.softmax(logit.masked_fill(~m, float("-inf")), -1)
    o = (a[:, None, :] @ V.repeat_interleave(grp, 0)).squeeze(1)  # [H, hd]
    x = x + layer.wo(o.reshape(1, -1))
    hf = layer.ffn_norm(x)
    x = x + layer.w2(torch.nn.functional.silu(layer.w1(hf)) * layer.w3(hf))
    return x, K, V, dense, m
