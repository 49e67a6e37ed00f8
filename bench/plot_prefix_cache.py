#!/usr/bin/env python3
"""Plots bench_prefix_cache JSON: time to first token per turn with prefix caching off, on, and on
with evicted prefixes offloaded to host memory (and, with --disk / --remote, to disk or a KV node's memory only) (left), prompt tokens computed and taken from the cache per mode (right)."""
import json
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

path = sys.argv[1]
doc = json.load(open(path))
def mode_name(mode):
    if "mode" in mode:
        return mode["mode"]
    if not mode["prefix_caching"]:
        return "off"
    if mode.get("prefix_disk_bytes", 0) > 0:
        return "on + disk"
    return "on + offload" if mode.get("prefix_offload_bytes", 0) > 0 else "on"


fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
for mode in doc["modes"]:
    label = mode_name(mode)
    turns = mode["turns"]
    a.plot([t["prompt_tokens"] for t in turns], [t["ttft_p50_ms"] for t in turns], "-o", label=label)
a.set_xlabel("prompt tokens of the turn")
a.set_ylabel("time to first token, p50 (ms)")
a.grid(True, alpha=0.3)
a.legend(fontsize=8)
names = [mode_name(m) for m in doc["modes"]]
computed = [m["prompt_tokens_computed"] for m in doc["modes"]]
cached = [m["prompt_tokens_cached"] for m in doc["modes"]]
b.bar(names, computed, label="computed")
b.bar(names, cached, bottom=computed, label="from the cache")
b.set_ylabel("prompt tokens")
b.set_xlabel("prefix caching")
b.legend(fontsize=8)
fig.suptitle(f"{doc['model']} ({doc['layers']} layers): {doc['conversations']} conversations x {doc['turns']} turns, "
             f"wall x{doc['wall_ratio_off_over_on']:.2f}, TTFT x{doc['ttft_ratio_off_over_on']:.2f} (off / on); "
             f"wall x{doc.get('wall_ratio_on_over_offload', 0):.2f}, TTFT x{doc.get('ttft_ratio_on_over_offload', 0):.2f} "
             "(on / on + offload)" +
             (f"; wall x{doc['wall_ratio_disk_over_offload']:.2f} (disk / host memory)"
              if "wall_ratio_disk_over_offload" in doc else ""),
             fontsize=10)
out = path.rsplit(".", 1)[0] + ".png"
fig.tight_layout()
fig.savefig(out, dpi=120)
print(out)
