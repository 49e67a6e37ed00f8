#!/usr/bin/env python3
"""Tests of cluster/launch.py (the topology launcher), run by ctest:

  launch_test.py local --bin SPECONTEXT --root SOURCE_DIR [--kv-nodes 1]
  launch_test.py netns --bin SPECONTEXT --root SOURCE_DIR [--kv-nodes 1]

local: a start-up failure is reported with the process's stderr and torn down; then 2 replicas
(behind delaying proxies) + router + Redis store + kv-node on stories260K: completions through the
router answer, the store is shared, status is healthy, a killed replica is reported, the router
still answers, a restarted replica is back in the router, down leaves no process. netns: the same kind of topology, each process in its own
namespace on a bridge with tc tbf links; exits 77 (skipped) where namespaces or tbf are unavailable;
a bulk transfer over a shaped link measures within (0.3, 2.0) x the configured rate; down leaves no
namespace, link or process.
"""
import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import time

SKIP = 77
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)
    return cond


def launcher(root, *args, timeout=300):
    r = subprocess.run([sys.executable, os.path.join(root, "cluster", "launch.py")] + list(args),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)
    return r.returncode, r.stdout, r.stderr


def request(method, url, path, body=None, timeout=60):
    hostport = url.split("://", 1)[-1]
    host, port = hostport.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        c.request(method, path, body=json.dumps(body) if body is not None else None,
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read().decode("utf-8", "replace")
    finally:
        c.close()


def metric(url, name):
    status, body = request("GET", url, "/metrics")
    for line in body.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def pid_alive(pid, starttime):
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return False
    fields = s[s.rindex(")") + 2:].split()
    return fields[0] not in ("Z", "X") and int(fields[19]) == starttime


def state_of(run_dir):
    with open(os.path.join(run_dir, "state.json")) as f:
        return json.load(f)


def no_process_left(run_dir, label):
    st = state_of(run_dir)
    left = [c["name"] for c in st["components"] if c.get("pid") and pid_alive(c["pid"], c["starttime"])]
    check(not left, f"{label}: no process of the run left (left: {left})")


PROMPT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the sun "
          "with her dog. One day, she saw a big red ball in the park and she ran to get it.")


def complete(router, prompt=PROMPT, max_tokens=8):
    return request("POST", router, "/v1/completions",
                {"model": "stories", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def base_spec(a, mode):
    return {"mode": mode, "binary": a.bin, "model": os.path.join(a.root, "models/stories260K/stories260K.bin"),
            "serve_args": ["--served-model-name", "stories", "--max-batch", "4", "--drain-seconds", "2"],
            "kv_nodes": {"count": a.kv_nodes, "capacity": "16MiB", "use": "tier", "size": "1MiB"},
            "store": {"type": "redis"}, "router": {"policy": "rr"}, "nice": 5, "startup_timeout_s": 180}


def write_spec(tmp, name, spec):
    path = os.path.join(tmp, name)
    with open(path, "w") as f:
        json.dump(spec, f)
    return path


def test_local(a, tmp):
    # 1. a start-up that fails: the replica's error is shown, what was started is stopped
    bad = base_spec(a, "local")
    bad["serve_args"] = bad["serve_args"] + ["--no-such-flag"]
    run_bad = os.path.join(tmp, "run-bad")
    rc, out, err = launcher(a.root, "up", write_spec(tmp, "bad.json", bad), "--run-dir", run_bad)
    check(rc != 0, f"up with a bad serve flag fails (rc {rc})")
    check("replica-0" in err and "no-such-flag" in err, "the failure names the replica and shows its stderr")
    no_process_left(run_bad, "failed up")

    # a misspelt field is refused before anything starts
    rc, out, err = launcher(a.root, "up", write_spec(tmp, "typo.json", {"mode": "local", "replicsa": 2}),
                            "--run-dir", os.path.join(tmp, "run-typo"))
    check(rc != 0 and "replicsa" in err, f"a misspelt spec field is refused ({err.strip()[:120]})")

    # 2. the topology, replicas behind 50 ms delaying proxies
    spec = base_spec(a, "local")
    spec["replicas"] = 2
    spec["delay_ms"] = {"replica": 50}
    run_dir = os.path.join(tmp, "run")
    rc, out, err = launcher(a.root, "up", write_spec(tmp, "local.json", spec), "--run-dir", run_dir)
    if not check(rc == 0, f"up (rc {rc}) {err[-2000:]}"):
        return
    try:
        ep = json.loads(out)
        check(len(ep.get("replicas", [])) == 2 and ep.get("router") and ep.get("store", "").startswith("redis://")
              and len(ep.get("kv_nodes", [])) == a.kv_nodes, f"up prints the endpoints: {out.strip()}")
        mode = os.stat(os.path.join(run_dir, "store.password")).st_mode & 0o777
        check(mode == 0o600, f"store password file is 0600 ({oct(mode)})")
        if a.kv_nodes:
            mode = os.stat(os.path.join(run_dir, "kv.secret")).st_mode & 0o777
            check(mode == 0o600, f"kv secret file is 0600 ({oct(mode)})")
            cmds = " ".join(" ".join(c["cmd"]) for c in state_of(run_dir)["components"])
            with open(os.path.join(run_dir, "kv.secret")) as f:
                check(f.read().strip() not in cmds, "the kv secret is on no command line")

        s1, b1 = complete(ep["router"])
        s2, b2 = complete(ep["router"])
        check(s1 == 200 and json.loads(b1)["choices"][0]["text"], f"a completion through the router answers ({s1})")
        check(s2 == 200 and json.loads(b2)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0,
              f"the repeated prompt is served from a cache ({s2} {b2[-160:]})")
        st = state_of(run_dir)
        direct = {c["name"]: f"http://{c['addr']}:{c['port']}" for c in st["components"] if c["role"] == "replica"}
        writes = sum(metric(u, "specontext_prefix_store_writes_total") or 0 for u in direct.values())
        check(writes >= 1, f"replicas wrote the prompt to the Redis store ({writes})")

        t0 = time.monotonic()
        status, _ = request("GET", ep["replicas"][0], "/health")
        dt = time.monotonic() - t0
        check(status == 200 and dt >= 0.095, f"/health through the 50 ms proxy takes >= 0.095 s (2 x 50 ms) ({dt:.3f} s)")

        rc, out, _ = launcher(a.root, "status", run_dir)
        st = json.loads(out)
        check(rc == 0 and st["healthy"] and all(c["healthy"] for c in st["components"]),
              f"status: all healthy (rc {rc})")

        rc, out, _ = launcher(a.root, "kill", run_dir, "replica", "1")
        check(rc == 0 and json.loads(out)["gone"], f"kill replica 1 ({out.strip()})")
        rc, out, _ = launcher(a.root, "status", run_dir)
        st = json.loads(out)
        health = {c["name"]: c["healthy"] for c in st["components"]}
        check(rc == 1 and not st["healthy"] and health["replica-1"] is False and health["replica-0"]
              and health["router"] and health["store"], f"status reports replica-1 down, the rest up ({health})")
        answered = sum(complete(ep["router"], "Lily", 4)[0] == 200 for _ in range(4))
        check(answered == 4, f"the router still answers with one replica killed ({answered}/4)")

        rc, out, err = launcher(a.root, "restart", run_dir, "replica", "1")
        check(rc == 0, f"restart replica 1 at its port ({out.strip()} {err.strip()})")
        rc, out, _ = launcher(a.root, "status", run_dir)
        check(rc == 0 and json.loads(out)["healthy"], f"status: all healthy again after the restart (rc {rc})")
        up = None
        for _ in range(600):  # the router's health check (every 1 s) marks it up again
            status, body = request("GET", ep["router"], "/health")
            up = json.loads(body).get("replicas_up")
            if up == 2:
                break
            time.sleep(0.1)
        check(up == 2, f"the router sees the restarted replica (replicas_up {up})")
    finally:
        rc, out, err = launcher(a.root, "down", run_dir)
        check(rc == 0, f"down (rc {rc}) {err}")
    no_process_left(run_dir, "down")
    for name in ("kv.secret", "store.password", "redis.conf"):
        check(not os.path.exists(os.path.join(run_dir, name)), f"down removed {name}")
    rc, _, _ = launcher(a.root, "down", run_dir)
    check(rc == 0, "down again is a no-op (idempotent)")


def netns_available():
    if os.geteuid() != 0:
        return "not root"
    import shutil
    if not shutil.which("ip"):
        return "no ip command (iproute2)"
    ns = f"spx-probe-{os.getpid()}"
    try:
        r = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True)
        if r.returncode != 0:
            return f"ip netns add: {r.stderr.strip()}"
        r = subprocess.run(["ip", "-n", ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            return f"veth: {r.stderr.strip()}"
        r = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "p0", "root", "tbf",
                            "rate", "10mbit", "burst", "32kb", "latency", "50ms"], capture_output=True, text=True)
        if r.returncode != 0:
            return f"tc tbf: {r.stderr.strip()}"
        r = subprocess.run(["ip", "link", "add", f"spxpb{os.getpid() % 100000}", "type", "bridge"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            return f"bridge: {r.stderr.strip()}"
        subprocess.run(["ip", "link", "del", f"spxpb{os.getpid() % 100000}"], capture_output=True)
        return None
    except FileNotFoundError as e:
        return str(e)
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_netns(a, tmp):
    why = netns_available()
    if why:
        print(f"SKIP: network namespaces unavailable here: {why}")
        return SKIP
    spec = base_spec(a, "netns")
    spec["replicas"] = 2
    spec["links"] = {"rate": "20mbit", "roles": {"router": "100mbit"}}
    run_dir = os.path.join(tmp, "run")
    rc, out, err = launcher(a.root, "up", write_spec(tmp, "netns.json", spec), "--run-dir", run_dir)
    if not check(rc == 0, f"up (rc {rc}) {err[-2000:]}"):
        return 1
    st = state_of(run_dir)
    try:
        ep = json.loads(out)
        nss = {l.split()[0] for l in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                      text=True).stdout.splitlines() if l.strip()}
        check(all(c["ns"] in nss for c in st["components"]), "every component has its namespace")
        s, b = complete(ep["router"])
        check(s == 200 and json.loads(b)["choices"][0]["text"], f"a completion through the router answers ({s})")
        rc, out, _ = launcher(a.root, "status", run_dir)
        check(rc == 0 and json.loads(out)["healthy"], f"status: all healthy (rc {rc})")
        qd = subprocess.run(["tc", "qdisc", "show", "dev", st["components"][0]["veth_host"]],
                            capture_output=True, text=True).stdout
        check("tbf" in qd and "20Mbit" in qd, f"the store's link is shaped by tbf: {qd.strip()}")
        # replica -> store crosses two 20 Mbit/s tbf links (out of one namespace, into the other)
        for src, dst in (("replica-0", "store"), ("host", "replica-1")):
            rc, out, err = launcher(a.root, "bandwidth", run_dir, src, dst, "--seconds", "3")
            if check(rc == 0, f"bandwidth {src} -> {dst} runs ({err.strip()})"):
                m = json.loads(out)
                check(0.3 < m["ratio"] < 2.0, f"{src} -> {dst}: {m['measured_bit_s'] / 1e6:.2f} Mbit/s measured, "
                      f"{m['configured_bit_s'] / 1e6:.0f} configured, ratio {m['ratio']} in (0.3, 2.0)")
        rc, out, _ = launcher(a.root, "kill", run_dir, "store")
        rc, out, _ = launcher(a.root, "status", run_dir)
        health = {c["name"]: c["healthy"] for c in json.loads(out)["components"]}
        check(rc == 1 and health["store"] is False and health["router"], f"status reports the killed store ({health})")
        rc, out, err = launcher(a.root, "restart", run_dir, "store")
        check(rc == 0, f"restart store ({out.strip()} {err.strip()})")
        if a.kv_nodes:
            launcher(a.root, "kill", run_dir, "kv-node", "0")
            rc, out, err = launcher(a.root, "restart", run_dir, "kv-node", "0")
            check(rc == 0, f"restart kv-node 0 at its address ({out.strip()} {err.strip()})")
        rc, out, _ = launcher(a.root, "status", run_dir)
        check(rc == 0 and json.loads(out)["healthy"], f"status: all healthy after the restarts (rc {rc})")
        s, b = complete(ep["router"], "Lily", 4)
        check(s == 200, f"a completion through the router answers after the restarts ({s})")
    finally:
        rc, out, err = launcher(a.root, "down", run_dir)
        check(rc == 0, f"down (rc {rc}) {err}")
    no_process_left(run_dir, "down")
    nss = {l.split()[0] for l in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                  text=True).stdout.splitlines() if l.strip()}
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    check(not any(c["ns"] in nss for c in st["components"]), "down deleted every namespace")
    check(not any(c["veth_host"] + "@" in links for c in st["components"]), "down deleted every veth")
    check(st["bridge"] + ":" not in links, "down deleted the bridge")
    rc, _, _ = launcher(a.root, "down", run_dir)
    check(rc == 0, "down again is a no-op (idempotent)")
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["local", "netns"])
    ap.add_argument("--bin", required=True)
    ap.add_argument("--root", required=True)
    ap.add_argument("--kv-nodes", type=int, default=1)
    a = ap.parse_args()
    import shutil
    if not shutil.which("redis-server"):
        print("SKIP: no redis-server")
        return SKIP
    with tempfile.TemporaryDirectory(prefix="spx-launch-test-") as tmp:
        rc = test_local(a, tmp) if a.mode == "local" else test_netns(a, tmp)
        if rc == SKIP:
            return SKIP
    print(f"{len(failures)} failure(s)" + (": " + "; ".join(failures) if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
