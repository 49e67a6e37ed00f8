#!/usr/bin/env python3
"""Plots bench_hostile_load JSON: normal clients' latency percentiles alone and under attack
(left), /health latency (middle), and what each attack kind was answered (right)."""
import json
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

path = sys.argv[1]
doc = json.load(open(path))
b, u, h = doc["baseline"], doc["under_attack"], doc["health"]
fig, (a, m, r) = plt.subplots(1, 3, figsize=(15, 4.5))
names = ["ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "latency_p50_ms", "latency_p99_ms"]
x = range(len(names))
a.bar([i - 0.2 for i in x], [b[n] for n in names], 0.4, label="baseline")
a.bar([i + 0.2 for i in x], [u[n] for n in names], 0.4, label="under attack")
a.set_xticks(list(x))
a.set_xticklabels([n.replace("_ms", "") for n in names], rotation=30, fontsize=8)
a.set_ylabel("ms")
a.set_title(f"normal clients (failed {u['failed']}, wrong {u['wrong_text']})", fontsize=9)
a.legend(fontsize=8)
m.bar([-0.2, 0.8], [h["baseline_p50_ms"], h["baseline_p99_ms"]], 0.4, label="baseline")
m.bar([0.2, 1.2], [h["attack_p50_ms"], h["attack_p99_ms"]], 0.4, label="under attack")
m.set_xticks([0, 1])
m.set_xticklabels(["p50", "p99"])
m.set_ylabel("ms")
m.set_title(f"/health (failures {h['baseline_failures']} / {h['attack_failures']})", fontsize=9)
m.legend(fontsize=8)
kinds = sorted(doc["answers_by_kind"])
answers = sorted({k for v in doc["answers_by_kind"].values() for k in v})
bottom = [0] * len(kinds)
for ans in answers:
    vals = [doc["answers_by_kind"][k].get(ans, 0) for k in kinds]
    r.bar(kinds, vals, bottom=bottom, label=ans)
    bottom = [p + q for p, q in zip(bottom, vals)]
r.set_yscale("log")
r.tick_params(axis="x", rotation=40, labelsize=8)
r.set_title(f"answers per attack kind ({doc['attacks']} attacks, alive after: {doc['server_alive_after']})", fontsize=9)
r.legend(fontsize=7)
fig.tight_layout()
out = path.rsplit(".", 1)[0] + ".png"
fig.savefig(out, dpi=110)
print(out)
