#!/usr/bin/env python3
"""Markdown tables of bench/sim/must_show.sh's reports (bench/RESULTS.md).
    must_show_tables.py scaling [DIR]   measured run 1 / run 2 -> predicted (error against their mean)
    must_show_tables.py faults [DIR]    each fault run beside the first run without a fault"""
import json
import os
import sys

TRACES = {"p10": "Poisson 10/s", "b16": "bursts of 16, 10/s", "sat": "Poisson 100/s"}


def load(path):
    with open(path) as f:
        return json.load(f)


def get(d, path):
    for k in path.split("."):
        d = d[k]
    return d


def replicas(doc):
    """(router metrics, [serve metrics]) of a bench_loadgen report."""
    router, serves = {}, []
    for target, m in doc["metrics"].items():
        if "router" in m:
            router = m["router"]
        elif "serve" in m:
            serves.append(m["serve"])
    return router, serves


def store_hit_rate(serves):
    hits = sum(s["shared_store"]["hits"] for s in serves)
    misses = sum(s["shared_store"]["misses"] for s in serves)
    return hits / (hits + misses) if hits + misses > 0 else 0.0


def measured(doc, metric):
    router, serves = replicas(doc)
    if metric == "router_hit_rate":
        return router.get("prefix_hit_rate", 0.0)
    if metric == "store_hit_rate":
        return store_hit_rate(serves)
    return get(doc["summary"], metric)


def predicted(doc, metric):
    if metric == "router_hit_rate":
        return doc["metrics"]["router"]["prefix_hit_rate"]
    if metric == "store_hit_rate":
        return doc["metrics"]["serve"]["shared_store"]["hit_rate"]
    return get(doc["summary"], metric)


def fmt(v):
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}" if a < 0.1 else f"{v:.3f}"


def scaling(d):
    configs = [("1", "rr", ""), ("2", "rr", ""), ("4", "rr", ""), ("4", "prefix", ""), ("1", "rr", "_store"), ("2", "rr", "_store"), ("4", "rr", "_store")]
    tables = [
        ["requests_per_s", "goodput_requests_per_s", "cached_fraction", "router_hit_rate", "store_hit_rate"],
        ["ttft_ms.p50", "ttft_ms.p99", "itl_ms.p50", "itl_ms.p99", "latency_s.p50", "latency_s.p99"],
    ]
    heads = [["req/s", "goodput req/s", "cached fraction", "router hit rate", "store hit rate"],
             ["TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "latency p50 ms", "latency p99 ms"]]
    within = total = 0
    for metrics, head in zip(tables, heads):
        print("| trace | R | policy | store | " + " | ".join(head) + " |")
        print("| --- " * (4 + len(head)) + "|")
        for t, tname in TRACES.items():
            for n, policy, store in configs:
                base = os.path.join(d, f"{t}_r{n}_{policy}{store}")
                runs = [load(f"{base}_{k}.json") for k in (1, 2) if os.path.exists(f"{base}_{k}.json")]
                if not runs or not os.path.exists(base + "_pred.json"):
                    continue
                pred = load(base + "_pred.json")
                cells = []
                for m in metrics:
                    scale = 1000 if m.startswith("latency_s") else 1
                    ms = [scale * measured(r, m) for r in runs]
                    p = scale * predicted(pred, m)
                    mean = sum(ms) / len(ms)
                    if (m == "router_hit_rate" and policy == "rr") or (m == "store_hit_rate" and not store):
                        cells.append(" / ".join(fmt(x) for x in ms) + " → " + fmt(p))
                        continue
                    err = (p - mean) / mean if mean else 0.0
                    total += 1
                    within += abs(err) <= 0.15
                    cells.append(" / ".join(fmt(x) for x in ms) + f" → {fmt(p)} ({100 * err:+.0f}%)")
                print(f"| {tname} | {n} | {policy} | {'yes' if store else 'no'} | " + " | ".join(cells) + " |")
        print()
    print(f"{within} of {total} cells within 15%")


def fault_row(d, trace, name, base_doc):
    doc = load(os.path.join(d, f"fault_{trace}_{name}.json"))
    s = doc["summary"]
    router, serves = replicas(doc)
    computed = sum(x["prompt_tokens_computed"] for x in serves)
    cached = sum(x["prompt_tokens_cached"] for x in serves)
    st = {k: sum(x["shared_store"][k] for x in serves) for k in ("hits", "misses", "errors")}
    host = {k: sum(x["host_tier"][k] for x in serves) for k in ("offloads", "restores")}
    cmp_path = os.path.join(d, f"fault_{trace}_{name}.compare.json")
    c = load(cmp_path) if os.path.exists(cmp_path) else None
    kv = os.path.join(d, f"fault_{trace}_{name}.json.kvnodes.jsonl")
    kvb = ""
    if os.path.exists(kv):
        lines = [json.loads(x) for x in open(kv)]
        after = [x for x in lines if x["when"] == "after"]
        before = {x["node"]: x["stats"] for x in lines if x["when"] == "before"}
        parts = []
        for x in after:
            b = before.get(x["node"], {})
            if "error" in x["stats"]:
                parts.append("dead")
            else:
                w = (x["stats"]["bytes_scattered"] - b.get("bytes_scattered", 0)) / 1e6
                r = (x["stats"]["bytes_gathered"] - b.get("bytes_gathered", 0)) / 1e6
                parts.append(f"{w:.1f}/{r:.1f}")
        kvb = " · ".join(parts)
    return {
        "run": name,
        "ok": f"{s['ok']}/{s['requests']}",
        "failed": s["errors"],
        "same": c["same"] if c else "–",
        "wrong": f"{c['different']} ({c['different_same_cached']})" if c else "–",
        "prompt_changed": c["prompt_changed"] if c else "–",
        "req/s": fmt(s["requests_per_s"]),
        "ttft": f"{fmt(s['ttft_ms']['p50'])} / {fmt(s['ttft_ms']['p99'])}",
        "latency": f"{fmt(1000 * s['latency_s']['p50'])} / {fmt(1000 * s['latency_s']['p99'])}",
        "computed": f"{computed:.0f}",
        "cached": f"{cached:.0f}",
        "store": f"{st['hits']:.0f} / {st['misses']:.0f} / {st['errors']:.0f}",
        "offload": f"{host['offloads']:.0f} / {host['restores']:.0f}",
        "kv": kvb,
        "router": f"{router.get('retries', 0):.0f} / {router.get('failed_mid_answer', 0):.0f} / {router.get('unavailable', 0):.0f}",
    }


def faults(d, trace="p10"):  # trace: the file names' part, e.g. p10 or p10_dense
    cols = [("run", "run"), ("ok", "ok"), ("failed", "failed"), ("same", "same text"), ("wrong", "other text (with the same cached tokens)"),
            ("prompt_changed", "not comparable"), ("req/s", "req/s"), ("ttft", "TTFT p50 / p99 ms"),
            ("latency", "latency p50 / p99 ms"), ("computed", "prompt tokens computed"),
            ("cached", "cached"), ("store", "store hits / misses / errors"),
            ("offload", "serve prefix offloads / restores"),
            ("kv", "kv-node a · b MB written/read"), ("router", "router retries / failed mid-answer / unavailable")]
    print("| " + " | ".join(h for _, h in cols) + " |")
    print("| --- " * len(cols) + "|")
    base = load(os.path.join(d, f"fault_{trace}_none_1.json"))
    for name in ("none_1", "none_2", "replica", "kv-node", "kv-node-a", "store"):
        if not os.path.exists(os.path.join(d, f"fault_{trace}_{name}.json")):
            continue
        r = fault_row(d, trace, name, base)
        print("| " + " | ".join(str(r[k]) for k, _ in cols) + " |")


if __name__ == "__main__":
    what = sys.argv[1]
    d = sys.argv[2] if len(sys.argv) > 2 else "bench_out/i31"
    if what == "scaling":
        scaling(d)
    else:
        faults(d, sys.argv[3] if len(sys.argv) > 3 else "p10")
