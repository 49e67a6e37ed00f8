#!/usr/bin/env python3
"""Plots bench_growing_trace JSON: decode tokens/s and layers offloaded vs sequence length, one
line per placement (dynamic re-planning, static plan, all-device)."""
import json
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

path = sys.argv[1]
doc = json.load(open(path))
fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
for i, run in enumerate(r for r in doc["runs"] if "samples" in r):
    s = run["samples"]
    x = [p["length"] for p in s]
    color = f"C{i}"
    ax1.plot(x, [p["tokens_per_s"] for p in s], "-", color=color,
             label=f"{run['mode']} ({run['decode_tokens_per_s']:.1f} tok/s overall)")
    ax2.step(x, [p["layers_offloaded"] for p in s], where="post", color=color, label=run["mode"])
w = doc["workload"]
ax1.set_ylabel("decode tokens/s (all sequences)")
ax1.set_title(f"growing trace: {w['requests']} x prompt {w['prompt']} -> {w['until']} tokens, {w['method']} "
              f"B={w['budget']}, device {w['device_kv']}, host {w['host_kv']}")
ax1.grid(True, alpha=0.3)
ax1.legend(fontsize=8)
ax2.set_xlabel("tokens per sequence")
ax2.set_ylabel(f"layers offloaded (of {doc['model']['layers']})")
ax2.grid(True, alpha=0.3)
ax2.legend(fontsize=8)
fig.tight_layout()
out = path.rsplit(".", 1)[0] + ".png"
fig.savefig(out, dpi=120)
print(f"wrote {out}")
