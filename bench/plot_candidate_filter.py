#!/usr/bin/env python3
"""Plots bench_candidate_filter JSON: synthetic recall and speed-up vs length per (B, C), and the
real model's recall per (page, B, C)."""
import json
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

path = sys.argv[1]
doc = json.load(open(path))
syn = doc.get("synthetic")
real = doc.get("real")
panels = (2 if syn else 0) + (1 if real else 0)
fig, axes = plt.subplots(1, max(panels, 1), figsize=(5.5 * max(panels, 1), 4.5), squeeze=False)
axes = list(axes[0])
if syn:
    ax_r, ax_s = axes.pop(0), axes.pop(0)
    keys = sorted({(r["budget"], r["multiplier"]) for r in syn["results"]})
    for i, (b, m) in enumerate(keys):
        rows = sorted((r for r in syn["results"] if r["budget"] == b and r["multiplier"] == m),
                      key=lambda r: r["length"])
        x = [r["length"] for r in rows]
        c = f"C{i}"
        ax_r.plot(x, [r["mass_recall"] for r in rows], "o-", color=c, label=f"B {b}, C {m}B mass")
        ax_r.plot(x, [r["token_recall"] for r in rows], "x--", color=c, label=f"B {b}, C {m}B tokens")
        ax_s.plot(x, [r["speedup_vs_serial"] for r in rows], "o-", color=c, label=f"B {b}, C {m}B vs serial")
        ax_s.plot(x, [r["speedup_vs_parallel"] for r in rows], "x--", color=c, label=f"B {b}, C {m}B vs TBB")
    for ax in (ax_r, ax_s):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (tokens)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    ax_r.set_ylabel("recall of the full-scoring selection")
    ax_r.set_ylim(0, 1.02)
    ax_r.set_title(f"SYNTHETIC keys, 32q/8kv/128, page {syn['results'][0]['page_size']}", fontsize=9)
    ax_s.set_yscale("log")
    ax_s.set_ylabel("full scoring time / (shortlist + candidate scoring)")
    ax_s.set_title(f"speed-up, {syn['threads']} threads", fontsize=9)
if real:
    ax = axes.pop(0)
    rows = real["results"]
    labels = [f"P{r['page_size']} B{r['budget']} C{r['multiplier']}B" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["mass_recall"] for r in rows], width=0.4, label="mass recall")
    ax.bar([i + 0.2 for i in x], [r["token_recall"] for r in rows], width=0.4, label="token recall")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, rotation=70, fontsize=6)
    ax.set_ylim(0, 1.02)
    ax.set_title(f"REAL stories260K head, {real['tokens']} tokens", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
fig.tight_layout()
out = path.rsplit(".", 1)[0] + ".png"
fig.savefig(out, dpi=120)
print(f"wrote {out}")
