"""One dense PyTorch forward of the longctx model that keeps what the analysis scripts read: per
layer the K/V cache (after RoPE), the residual stream entering it and the last position's
attention weights. fidelity.py (its dense prefill) and attend.py (where an answer looks) share it."""
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
