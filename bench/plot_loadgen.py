#!/usr/bin/env python3
"""Plots bench_loadgen JSON: per request over the run, TTFT against its send time (within the SLO
or not, failed marked) with the running request count (top left); TTFT and request latency CDFs
(top right); TTFT against prompt tokens by request kind, the context growth of sessions (bottom
left); output tokens/s finished per second and arrivals per second (bottom right)."""
import json
import math
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

path = sys.argv[1]
doc = json.load(open(path))
reqs = doc["requests"]
s = doc["summary"]
fig, ((a, b), (c, d)) = plt.subplots(2, 2, figsize=(12, 8))

good = [r for r in reqs if r["ok"] and r["within_slo"]]
late = [r for r in reqs if r["ok"] and not r["within_slo"]]
bad = [r for r in reqs if not r["ok"]]
a.scatter([r["sent_at_s"] for r in good], [r["ttft_ms"] for r in good], s=12, label="within SLO")
a.scatter([r["sent_at_s"] for r in late], [r["ttft_ms"] for r in late], s=12, marker="^", label="outside SLO")
if bad:
    floor = min([r["ttft_ms"] for r in reqs if r["ok"]] or [1.0])
    a.scatter([r["sent_at_s"] for r in bad], [floor] * len(bad), s=20, marker="x", color="red", label="failed")
a.axhline(s["slo"]["ttft_ms"], color="gray", ls="--", lw=1, label=f"TTFT SLO {s['slo']['ttft_ms']:.0f} ms")
a.set_yscale("log")
a.set_xlabel("sent at (s)")
a.set_ylabel("TTFT (ms, log)")
a.grid(True, alpha=0.3)
a.legend(fontsize=8, loc="center left")
# Requests in flight over time (sent → finished).
events = []
for r in reqs:
    if r["ok"]:
        events += [(r["sent_at_s"], 1), (r["sent_at_s"] + r["latency_s"], -1)]
events.sort()
t, n, ts, ns = 0, 0, [], []
for t, dn in events:
    ts.append(t)
    ns.append(n)
    n += dn
    ts.append(t)
    ns.append(n)
a2 = a.twinx()
a2.plot(ts, ns, color="tab:green", lw=0.8, alpha=0.6)
a2.set_ylabel("requests in flight", color="tab:green")

for key, label, scale in (("ttft_ms", "TTFT", 1e-3), ("latency_s", "request latency", 1.0)):
    v = sorted(r[key] * scale for r in reqs if r["ok"])
    if v:
        b.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=label)
b.set_xscale("log")
b.set_xlabel("seconds (log)")
b.set_ylabel("fraction of requests")
b.grid(True, alpha=0.3)
b.legend(fontsize=8)

kinds = sorted({r["kind"] or "-" for r in reqs})
for k in kinds:
    rk = [r for r in reqs if r["ok"] and (r["kind"] or "-") == k]
    c.scatter([r["prompt_tokens"] for r in rk], [r["ttft_ms"] for r in rk], s=12, label=k)
c.set_xlabel("prompt tokens (the session's context so far + this turn)")
c.set_ylabel("TTFT (ms)")
c.grid(True, alpha=0.3)
c.legend(fontsize=8, title="kind")

if reqs:
    end = max([r["sent_at_s"] + r["latency_s"] for r in reqs] + [r["scheduled_at_s"] for r in reqs])
    bins = max(1, int(math.ceil(end)))
    done = [0.0] * bins
    arrived = [0] * bins
    for r in reqs:
        arrived[min(bins - 1, int(r["scheduled_at_s"]))] += 1
        if r["ok"]:
            done[min(bins - 1, int(r["sent_at_s"] + r["latency_s"]))] += r["completion_tokens"]
    x = list(range(bins))
    d.bar(x, done, width=1.0, align="edge", alpha=0.6, label="output tokens finished / s")
    d.set_xlabel("time (s)")
    d.set_ylabel("output tokens / s")
    d2 = d.twinx()
    d2.step(x, arrived, where="post", color="tab:red", lw=1, label="arrivals / s")
    d2.set_ylabel("arrivals / s", color="tab:red")
    d.grid(True, alpha=0.3)
    d.legend(fontsize=8, loc="upper left")

syn = doc.get("synthetic")
what = (f"{syn['arrival']} {syn['rate']} req/s, {syn['requests']} requests, {syn['sessions']} sessions x "
        f"{syn['turns']} turns" if syn else doc["trace"])
fig.suptitle(f"bench_loadgen → {doc['target']}: {what}\n{s['ok']}/{s['requests']} ok, goodput "
             f"{s['goodput_requests_per_s']:.2f} req/s ({100 * s['goodput_fraction']:.0f}% within TTFT "
             f"{s['slo']['ttft_ms']:.0f} ms, TPOT {s['slo']['tpot_ms']:.0f} ms), {s['output_tokens_per_s']:.1f} "
             f"tok/s; TTFT p50 {s['ttft_ms']['p50']:.0f} / p99 {s['ttft_ms']['p99']:.0f} ms, ITL p50 "
             f"{s['itl_ms']['p50']:.0f} / p99 {s['itl_ms']['p99']:.0f} ms", fontsize=10)
out = path.rsplit(".", 1)[0] + ".png"
fig.tight_layout()
fig.savefig(out, dpi=120)
print(out)
