#!/usr/bin/env python3
"""Plots bench_preemption JSON: wall time (left) and prompt tokens computed and restored from the
store (right) per way of preempting."""
import json
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

path = sys.argv[1]
doc = json.load(open(path))
modes = doc["modes"]
names = [m["mode"] for m in modes]
fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4.2))
a.bar(names, [m["wall_s"] for m in modes])
for i, m in enumerate(modes):
    a.annotate(f"{m['preemptions']} preempted\n{m['preemption_swaps']} swapped", (i, m["wall_s"]),
               ha="center", va="bottom", fontsize=8)
a.set_ylabel("wall time (s)")
computed = [m["prompt_tokens_computed"] for m in modes]
restored = [m["prompt_tokens_restored"] for m in modes]
b.bar(names, computed, label="computed")
b.bar(names, restored, bottom=computed, label="restored from the store")
b.set_ylabel("prompt tokens")
b.legend(fontsize=8)
for ax in (a, b):
    ax.tick_params(axis="x", labelsize=8)
ratios = ", ".join(f"{m['mode']} x{m['wall_ratio_recompute_over_this']:.2f}" for m in modes[1:])
fig.suptitle(f"{doc['model']} ({doc['layers']} layers): {doc['requests']} requests x ({doc['prompt_tokens']} + "
             f"{doc['max_tokens']}) tokens on {doc['pool_fraction']:.0%} of their KV\nwall, recompute / {ratios}",
             fontsize=10)
out = path.rsplit(".", 1)[0] + ".png"
fig.tight_layout()
fig.savefig(out, dpi=120)
print(out)
