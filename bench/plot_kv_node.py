#!/usr/bin/env python3
"""Plots bench_kv_node JSON: GB/s of scattered rows vs row size, per data path (node-side gather,
one-sided RMA) and direction; contiguous 16 MiB transfers as horizontal references."""
import json
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

path = sys.argv[1]
doc = json.load(open(path))
res = doc["results"]
fig, ax = plt.subplots(figsize=(8, 5))
for i, mode in enumerate(["gather", "rma"]):
    for direction, style in [("read", "-o"), ("write", "--s")]:
        pts = sorted((r["row_bytes"], r["gb_per_s"]) for r in res
                     if r["mode"] == mode and r["direction"] == direction and r["pattern"] == "scattered")
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=f"C{i}", label=f"{mode} {direction}, scattered")
        cont = [r["gb_per_s"] for r in res if r["mode"] == mode and r["direction"] == direction and r["pattern"] == "contiguous"]
        if cont:
            ax.axhline(cont[0], color=f"C{i}", alpha=0.35, linestyle=":" if direction == "write" else "-.")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("row bytes")
ax.set_ylabel("GB/s")
rows = next((r["rows"] for r in res if r["pattern"] == "scattered"), 0)
ax.set_title(f"KV node ({doc['ucx_tls']}): {rows} scattered rows per batch; faint lines: 16 MiB contiguous", fontsize=10)
ax.grid(True, alpha=0.3, which="both")
ax.legend(fontsize=8)
out = path.rsplit(".", 1)[0] + ".png"
fig.tight_layout()
fig.savefig(out, dpi=120)
print(out)
