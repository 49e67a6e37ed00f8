#!/usr/bin/env python3
"""Plots bench_quant_gemv JSON: GB/s of stored weight bytes per type and path for each shape,
with the measured read bandwidth as the roofline, and tok/s-equivalent (Llama-3.2-1B body)."""
import json
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

path = sys.argv[1]
doc = json.load(open(path))
rows = doc["results"]
shapes = sorted({r["shape"] for r in rows}, key=lambda s: [int(v) for v in s.split("x")])
types = list(dict.fromkeys(r["type"] for r in rows))
paths = list(dict.fromkeys(r["path"] for r in rows if r["type"] != "F32"))
fig, axes = plt.subplots(2, len(shapes), figsize=(6 * len(shapes), 8), squeeze=False)
for col, shape in enumerate(shapes):
    sub = [r for r in rows if r["shape"] == shape]
    for row, (key, label) in enumerate([("gb_per_s", "GB/s of stored weights"),
                                        ("tok_per_s_equiv", "tok/s equivalent (Llama-3.2-1B body)")]):
        ax = axes[row][col]
        width = 0.8 / (len(paths) + 1)
        for ti, t in enumerate(types):
            cands = [r for r in sub if r["type"] == t]
            for r in cands:
                pi = 0 if t == "F32" else paths.index(r["path"]) + 1
                ax.bar(ti + (pi - len(paths) / 2) * width, r[key], width=width, color=f"C{pi}",
                       label=(r["path"] if t != "F32" else "f32 " + r["path"].split(":")[0]))
            if key == "tok_per_s_equiv" and cands:
                roof = cands[0]["tok_per_s_equiv"] * cands[0]["us_per_gemv"] / cands[0]["roofline_us"]
                ax.plot([ti - 0.45, ti + 0.45], [roof, roof], "k--", lw=1)
        if key == "gb_per_s":
            ax.axhline(doc["read_gb_per_s"], color="k", ls="--", lw=1, label="measured read bandwidth")
        ax.set_xticks(range(len(types)))
        ax.set_xticklabels(types)
        ax.set_ylabel(label)
        ax.set_title(f"{shape}, m = 1, {doc['machine']['threads']} threads" +
                     (" (dashes: roofline)" if key == "tok_per_s_equiv" else ""), fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        uniq = dict(zip(labels, handles))
        ax.legend(uniq.values(), uniq.keys(), fontsize=7)
fig.suptitle(doc["machine"]["cpu"], fontsize=9)
fig.tight_layout()
out = path.rsplit(".", 1)[0] + ".png"
fig.savefig(out, dpi=110)
print(f"wrote {out}")
