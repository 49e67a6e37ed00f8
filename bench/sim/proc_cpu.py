#!/usr/bin/env python3
"""CPU seconds of running processes, for bench/sim/cluster_run.sh's OUT.json.cpu.json.
    proc_cpu.py snap ROLE=PID ...      one JSON line: {"t": unix s, "machine": {...}, "procs": {ROLE: {...}}}
    proc_cpu.py merge BEFORE AFTER LOADGEN_TIME OUT   the sidecar JSON (see bench/sim/README.md)
A process's CPU is utime + stime of /proc/PID/stat (all its threads) plus cutime + cstime (its
waited-for children), in seconds; "machine" is /proc/stat's cpu line (busy and idle seconds over
all cores) and /proc/loadavg. A process already gone reads as null."""
import json
import os
import sys
import time

TCK = os.sysconf("SC_CLK_TCK")


def proc(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    fields = s[s.rindex(")") + 2:].split()  # fields from the 3rd (state) on
    ut, st, cut, cst = (int(fields[i]) for i in (11, 12, 13, 14))
    return {"pid": int(pid), "self_s": (ut + st) / TCK, "children_s": (cut + cst) / TCK,
            "cpu_s": (ut + st + cut + cst) / TCK}


def machine():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]  # idle + iowait
    with open("/proc/loadavg") as f:
        la = f.read().split()[:3]
    return {"busy_s": (sum(v[:8]) - idle) / TCK, "idle_s": idle / TCK, "loadavg": [float(x) for x in la],
            "cores": os.cpu_count()}


def snap(args):
    procs = {}
    for a in args:
        role, pid = a.split("=", 1)
        procs[role] = proc(pid)
    print(json.dumps({"t": time.time(), "machine": machine(), "procs": procs}))


def merge(before_path, after_path, loadgen_time_path, out):
    b = json.load(open(before_path))
    a = json.load(open(after_path))
    wall = a["t"] - b["t"]
    procs = {}
    for role, pa in a["procs"].items():
        pb = b["procs"].get(role)
        d = None
        if pa is not None and pb is not None:
            d = pa["cpu_s"] - pb["cpu_s"]
        procs[role] = {"pid": (pa or pb or {}).get("pid"), "cpu_s_before": pb and pb["cpu_s"],
                       "cpu_s": pa and pa["cpu_s"], "cpu_s_run": d}
    lg = {"cpu_s_run": None}
    try:
        user, sys_, el = open(loadgen_time_path).read().split()[-3:]
        lg = {"cpu_s_run": float(user) + float(sys_), "user_s": float(user), "sys_s": float(sys_),
              "wall_s": float(el)}
    except (OSError, ValueError):
        pass
    procs["loadgen"] = lg
    mb, ma = b["machine"], a["machine"]
    busy = ma["busy_s"] - mb["busy_s"]
    idle = ma["idle_s"] - mb["idle_s"]
    known = sum(p["cpu_s_run"] or 0 for p in procs.values())
    res = {
        "what": "CPU seconds per process over the trace (bench_loadgen's start to its exit); cpu_s_run = "
                "after - before (utime+stime+cutime+cstime, /proc/PID/stat); loadgen: its rusage",
        "wall_s": wall,
        "procs": procs,
        "machine": {"cores": ma["cores"], "busy_s": busy, "idle_s": idle,
                    "other_busy_s": busy - known, "loadavg_before": mb["loadavg"], "loadavg_after": ma["loadavg"]},
    }
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    if sys.argv[1] == "snap":
        snap(sys.argv[2:])
    elif sys.argv[1] == "merge":
        merge(*sys.argv[2:6])
    else:
        sys.exit(__doc__)
