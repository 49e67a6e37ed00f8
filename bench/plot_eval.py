#!/usr/bin/env python3
"""Plots `specontext eval --json` output: attention recall and KL(dense || method) vs budget, one
line per sparse method, dense as the reference line. Writes <json stem>.png."""
import json
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

path = sys.argv[1]
doc = json.load(open(path))
records = doc["records"]
order = ["streaming", "quest", "oracle", "specontext"]
methods = [m for m in order if any(r["method"] == m for r in records)]
fig, (ax_r, ax_kl) = plt.subplots(1, 2, figsize=(11, 4.5))
for i, m in enumerate(methods):
    rows = sorted((r for r in records if r["method"] == m), key=lambda r: r["budget"])
    b = [r["budget"] for r in rows]
    color = f"C{i}"
    ax_r.plot(b, [r["attention_recall"] for r in rows], "o-", color=color, label=m)
    # KL of a budget covering the whole context is 0: log axes skip it.
    kl = [(x["budget"], x["kl"]) for x in rows if x["kl"] > 0]
    if kl:
        ax_kl.plot([k[0] for k in kl], [k[1] for k in kl], "o-", color=color, label=m)
ax_r.axhline(1.0, color="k", linestyle="--", linewidth=1, label="dense")
ax_r.set_ylabel("attention-mass recall (mean over layers, heads, positions)")
ax_r.set_ylim(top=1.02)
ax_kl.set_yscale("log")
ax_kl.set_ylabel("KL(dense || method) of next-token distribution (nats)")
ax_kl.text(0.02, 0.02, "dense: KL = 0", transform=ax_kl.transAxes, fontsize=8)
for ax in (ax_r, ax_kl):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("budget (tokens per KV head)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
model = "/".join(doc["model"].rstrip("/").split("/")[-2:])
fig.suptitle(f"{model}: context {doc['context']}, {doc['positions']} teacher-forced positions, "
             f"sinks {doc['sinks']}, window {doc['window']}")
fig.tight_layout()
out = path.rsplit(".", 1)[0] + ".png"
fig.savefig(out, dpi=120)
print(f"wrote {out}")
