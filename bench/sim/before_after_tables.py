#!/usr/bin/env python3
"""Measured beside two predictions (before / after a simulator change), one markdown row per cell
and metric (bench/RESULTS.md, issue #31).
    before_after_tables.py [--within 0.15] LABEL=MEASURED[,MEASURED...]:BEFORE.json:AFTER.json ...
MEASURED: bench_loadgen reports (several: their mean is the reference); BEFORE / AFTER:
bench_cluster_sim --out reports. Metrics: req/s (completed requests / wall), refused (the
report's errors: serve's 429 / 503), cached fraction, store hit rate (cells with a store), TTFT
p50 / p99. Error = (predicted - mean measured) / mean measured. Then, for cells whose
reports have cluster_run.sh's CPU sidecars (OUT.json.cpu.json): the cores the router, load
generator and store took (their CPU seconds / wall) and serve's cores, beside the after-prediction's (its
overhead_cores split by the calibration's cpu_per_request; serve: its engines' busy time / wall,
at most the cores left to them, plus its share of the overhead)."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from must_show_tables import fmt, measured, predicted  # noqa: E402

METRICS = [("requests_per_s", "req/s"), ("errors", "refused"), ("cached_fraction", "cached fraction"),
           ("store_hit_rate", "store hit rate"), ("ttft_ms.p50", "TTFT p50 ms"), ("ttft_ms.p99", "TTFT p99 ms")]


def load(p):
    with open(p) as f:
        return json.load(f)


def main(argv):
    within = 0.15
    if argv and argv[0] == "--within":
        within = float(argv[1])
        argv = argv[2:]
    cells = []
    for a in argv:
        label, rest = a.split("=", 1)
        runs, before, after = rest.split(":")
        cells.append((label, [load(p) for p in runs.split(",")], runs.split(","), load(before), load(after)))
    print("| cell | metric | measured (runs) | before: predicted (error) | after: predicted (error) |")
    print("| --- | --- | --- | --- | --- |")
    count = {"before": [0, 0], "after": [0, 0]}
    for label, docs, _, before, after in cells:
        store = before["topology"]["store"]["enabled"]
        for key, name in METRICS:
            if key == "store_hit_rate" and not store:
                continue
            ms = [measured(d, key) for d in docs]
            m = sum(ms) / len(ms)
            row = [label, name, " / ".join(fmt(v) for v in ms)]
            for tag, doc in (("before", before), ("after", after)):
                p = predicted(doc, key)
                if m != 0:
                    e = (p - m) / abs(m)
                    count[tag][1] += 1
                    count[tag][0] += abs(e) <= within
                    row.append(f"{fmt(p)} ({100 * e:+.0f}%)")
                else:
                    row.append(fmt(p))
            print("| " + " | ".join(row) + " |")
    for tag, (ok, n) in count.items():
        print(f"\n{tag}: {ok} of {n} cells within {100 * within:.0f}%", end="")
    print()
    # CPU: measured cores beside the after-prediction's
    rows = []
    for label, docs, paths, _, after in cells:
        side = [p + ".cpu.json" for p in paths if os.path.exists(p + ".cpu.json")]
        if not side:
            continue
        # the after-prediction's cores: router + load generator + store, and the replicas (their
        # engines' busy time and their work beyond it)
        o = after.get("metrics", {}).get("cpu", {}).get("overhead_cores", 0.0)
        share = after.get("calibration", {}).get("cpu_per_request", {})
        topo = after["topology"]
        c_others = (share.get("router_s", 0) if topo.get("router", True) else 0) + share.get("loadgen_s", 0) + \
            (share.get("store_s", 0) if topo["store"]["enabled"] and topo["store"]["alive"] else 0)
        c_total = c_others + share.get("replica_s", 0)
        wall = after["summary"]["wall_s"]
        busy = sum(r["busy_s"] for r in after["metrics"]["serve"]["replicas"])
        p_others = o * c_others / c_total if c_total > 0 else 0.0
        cpus = topo.get("cpus", 0)
        engines = min(busy / wall, cpus - o) if cpus > 0 else busy / wall  # busy_s counts the slowed steps
        p_serve = engines + (o - p_others)
        meas = []
        for s in side:
            c = load(s)
            w = c["wall_s"]
            pr = c["procs"]
            others = sum((pr[k]["cpu_s_run"] or 0) for k in ("router", "loadgen", "redis") if k in pr)
            serve = sum((v["cpu_s_run"] or 0) for k, v in pr.items() if k.startswith("serve"))
            meas.append((others / w, serve / w, c["machine"]["other_busy_s"] / w))
        rows.append(f"| {label} | " + " / ".join(f"{a:.2f}" for a, _, _ in meas) + " | " +
                    f"{p_others:.2f} | " + " / ".join(f"{b:.2f}" for _, b, _ in meas) + f" | {p_serve:.2f} | " +
                    " / ".join(f"{x:.2f}" for _, _, x in meas) + " |")
    if rows:
        print("\n| cell | router + load generator + store: measured cores (runs) | predicted (after) | "
              "serve replicas: measured cores | predicted (after) | anything else on the machine, cores |")
        print("| --- | --- | --- | --- | --- | --- |")
        print("\n".join(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
