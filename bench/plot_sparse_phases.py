#!/usr/bin/env python3
"""Plots bench_sparse_phases JSON: per phase of the SpeContext sparse step, the measured time next
to its roofline time (bytes / measured read bandwidth), one panel per batch, and the fraction of
the roofline each phase reaches."""
import json
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

path = sys.argv[1]
doc = json.load(open(path))
rows = doc["results"]
batches = sorted({r["batch"] for r in rows})
phases = list(dict.fromkeys(r["phase"] for r in rows))
fig, axes = plt.subplots(1, len(batches) + 1, figsize=(5.5 * (len(batches) + 1), 4.5), squeeze=False)
for col, b in enumerate(batches):
    ax = axes[0][col]
    sub = {r["phase"]: r for r in rows if r["batch"] == b}
    xs = range(len(phases))
    ax.bar([x - 0.2 for x in xs], [sub[p]["seconds"] * 1e3 for p in phases], width=0.4, color="C0", label="measured (median)")
    ax.bar([x + 0.2 for x in xs], [sub[p]["roofline_seconds"] * 1e3 for p in phases], width=0.4, color="C1",
           label="roofline: bytes / read bandwidth")
    for x, p in zip(xs, phases):
        ax.annotate(f"{sub[p]['fraction_of_roofline']:.2f}", (x - 0.2, sub[p]["seconds"] * 1e3), ha="center",
                    va="bottom", fontsize=7)
    ax.set_yscale("log")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(phases)
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"batch {b} (numbers: fraction of roofline)", fontsize=9)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=7)
ax = axes[0][len(batches)]
for i, b in enumerate(batches):
    sub = {r["phase"]: r for r in rows if r["batch"] == b}
    ax.plot(phases, [sub[p]["fraction_of_roofline"] for p in phases], "o-", color=f"C{i}", label=f"batch {b}")
ax.axhline(1.0, color="k", ls="--", lw=1)
ax.set_yscale("log")
ax.set_ylabel("fraction of read roofline")
ax.set_title("fraction of roofline per phase", fontsize=9)
ax.grid(True, which="both", alpha=0.3)
ax.legend(fontsize=7)
fig.suptitle(f"SpeContext sparse step: {doc['model']} x {doc['layers']} layers, context {doc['context']}, "
             f"B = {doc['budget']}, {doc['kv_dtype']} KV, {doc['threads']} threads, read {doc['read_gb_per_s']:.1f} GB/s",
             fontsize=9)
fig.tight_layout()
out = path.rsplit(".", 1)[0] + ".png"
fig.savefig(out, dpi=110)
print(f"wrote {out}")
