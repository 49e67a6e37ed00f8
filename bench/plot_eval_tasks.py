#!/usr/bin/env python3
"""Plots the task suite of `specontext eval --json` (its "tasks" section): per method, a heat map
of accuracy over prompt length x needle depth (all tasks pooled) at the largest budget, as
needle-in-a-haystack plots show it; and accuracy vs budget per method at the longest length.
Writes <json stem>_tasks.png."""
import json
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

path = sys.argv[1]
doc = json.load(open(path))["tasks"]
recs = doc["records"]
order = ["dense", "streaming", "quest", "oracle", "specontext"]
methods = [m for m in order if any(r["method"] == m for r in recs)]
lengths, depths, budgets = doc["lengths"], doc["depths"], doc["budgets"]
top = max(budgets)


def acc(rows):
    t = sum(r["trials"] for r in rows)
    return sum(r["correct"] for r in rows) / t if t else float("nan")


fig = plt.figure(figsize=(3.2 * len(methods) + 4.5, 4.2))
gs = fig.add_gridspec(1, len(methods) + 1, width_ratios=[1] * len(methods) + [1.6])
for i, m in enumerate(methods):
    ax = fig.add_subplot(gs[0, i])
    b = 0 if m == "dense" else top
    grid = np.array([[acc([r for r in recs if r["method"] == m and r["budget"] == b and r["length"] == L
                           and r["depth"] == d]) for L in lengths] for d in depths])
    ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
    ax.set_xticks(range(len(lengths)), [str(L) for L in lengths], rotation=45)
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    for (y, x), v in np.ndenumerate(grid):
        ax.text(x, y, f"{v:.2f}", ha="center", va="center", fontsize=7)
    ax.set_title(m if m == "dense" else f"{m} B={b}", fontsize=9)
    ax.set_xlabel("prompt tokens")
    if i == 0:
        ax.set_ylabel("needle depth")
ax = fig.add_subplot(gs[0, len(methods)])
L = max(lengths)
dense = acc([r for r in recs if r["method"] == "dense" and r["length"] == L])
for i, m in enumerate(methods):
    if m == "dense":
        continue
    ys = [acc([r for r in recs if r["method"] == m and r["budget"] == b and r["length"] == L]) for b in budgets]
    ax.plot(budgets, ys, "o-", color=f"C{i}", label=m)
if dense == dense:
    ax.axhline(dense, color="k", linestyle="--", linewidth=1, label="dense")
ax.set_xscale("log", base=2)
ax.set_xlabel("budget (tokens per KV head)")
ax.set_ylabel(f"task accuracy at {L} tokens")
ax.set_ylim(-0.02, 1.02)
ax.legend(fontsize=8)
fig.suptitle("long-context tasks (all tasks pooled): accuracy by length x depth, and vs budget")
fig.tight_layout()
out = path.rsplit(".", 1)[0] + "_tasks.png"
fig.savefig(out, dpi=110)
print("wrote", out)
