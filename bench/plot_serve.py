#!/usr/bin/env python3
"""Plots bench_serve JSON: output tokens/s and the batching gain vs concurrent clients (left),
time to first token and inter-token latency (right)."""
import json
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

path = sys.argv[1]
doc = json.load(open(path))
pts = doc["points"]
c = [p["concurrency"] for p in pts]
fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
a.plot(c, [p["output_tokens_per_s"] for p in pts], "-o", label="output tokens/s")
for p in pts:
    a.annotate(f"x{p['speedup_vs_first_point']:.2f}", (p["concurrency"], p["output_tokens_per_s"]),
               textcoords="offset points", xytext=(4, -12), fontsize=8)
a.set_xscale("log", base=2)
a.set_xlabel("concurrent clients")
a.set_ylabel("output tokens/s")
a.grid(True, alpha=0.3)
a.legend(fontsize=8)
b.plot(c, [p["ttft_p50_ms"] for p in pts], "-o", label="TTFT p50")
b.plot(c, [p["itl_p50_ms"] for p in pts], "-s", label="inter-token p50")
b.set_xscale("log", base=2)
b.set_xlabel("concurrent clients")
b.set_ylabel("ms")
b.grid(True, alpha=0.3)
b.legend(fontsize=8)
fig.suptitle(f"{doc['model']} ({doc['layers']} layers, {doc['sparse']}): prompt {doc['prompt_tokens']}, "
             f"{doc['max_tokens']} new tokens, {doc['max_batch']} slots", fontsize=10)
out = path.rsplit(".", 1)[0] + ".png"
fig.tight_layout()
fig.savefig(out, dpi=120)
print(out)
