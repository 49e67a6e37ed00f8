#!/usr/bin/env python3
"""Plots bench_decode JSON: measured tokens/s and the roofline vs context, one line per batch."""
import json
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

path = sys.argv[1]
doc = json.load(open(path))
fig, ax = plt.subplots(figsize=(7, 4.5))
batches = sorted({r["batch"] for r in doc["results"]})
for i, b in enumerate(batches):
    rows = sorted((r for r in doc["results"] if r["batch"] == b), key=lambda r: r["context"])
    ctx = [r["context"] for r in rows]
    color = f"C{i}"
    ax.plot(ctx, [r["tokens_per_s"] for r in rows], "o-", color=color, label=f"batch {b} measured")
    ax.plot(ctx, [r["roofline_tokens_per_s"] for r in rows], "--", color=color, label=f"batch {b} roofline")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("context length (tokens)")
ax.set_ylabel("decode tokens/s")
ax.set_title(f"{doc['model']} ({doc['layers']} layers, {doc['dtype']}), triad {doc['triad_gb_per_s']:.1f} GB/s")
ax.grid(True, which="both", alpha=0.3)
ax.legend(fontsize=8)
fig.tight_layout()
out = path.rsplit(".", 1)[0] + ".png"
fig.savefig(out, dpi=120)
print(f"wrote {out}")
