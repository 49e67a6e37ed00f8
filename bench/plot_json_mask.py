#!/usr/bin/env python3
"""Plots bench_json_mask JSON: the time of one constraint mask at each token of the document, per
vocabulary (left), and how many tokens each mask leaves open (right)."""
import json
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

path = sys.argv[1]
doc = json.load(open(path))
fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
for r in doc["results"]:
    label = f"{r.get('constraint', 'json_object')}, {r['vocabulary']} ({r['vocab_size']} tokens)"
    steps = r["steps"]
    x = range(len(steps))
    a.plot(x, [s["mask_us_median"] for s in steps], "-", marker=".", label=f"{label}: p50 {r['mask_us_p50']:.1f} us")
    b.plot(x, [s["open_tokens"] for s in steps], "-", marker=".", label=label)
a.set_yscale("log")
a.set_xlabel("token of the document")
a.set_ylabel("mask time, median over passes (us)")
a.grid(True, alpha=0.3)
a.legend(fontsize=8)
b.set_yscale("log")
b.set_xlabel("token of the document")
b.set_ylabel("tokens left open by the mask")
b.grid(True, alpha=0.3)
b.legend(fontsize=8)
fig.suptitle(f"constrained decoding: one mask per step over the whole vocabulary ({doc['repeats']} passes)",
             fontsize=10)
out = path.rsplit(".", 1)[0] + ".png"
fig.tight_layout()
fig.savefig(out, dpi=120)
print(out)
