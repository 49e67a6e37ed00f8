#!/usr/bin/env python3
"""Topology launcher (issue #31 item 2): `serve` replicas, `kv-node`s, a Redis prefix store and a
`router`, as plain processes on 127.0.0.1 (mode "local") or each in its own Linux network namespace
on one bridge, links shaped by `tc tbf` (mode "netns"). Python 3 standard library only.

  cluster/launch.py up SPEC.json [--run-dir DIR]   start, health-check, print endpoints (JSON)
  cluster/launch.py status RUN_DIR                  health of every component (JSON; exit 1 if any is down)
  cluster/launch.py kill RUN_DIR COMPONENT [N]      kill one component: replica N, kv-node N, store, router
  cluster/launch.py down RUN_DIR                    kill everything, delete namespaces, links, bridge
  cluster/launch.py bandwidth RUN_DIR SRC DST       bulk TCP transfer SRC -> DST, measured at DST
  cluster/launch.py proxy --listen H:P --target H:P --delay-ms D   the delaying TCP proxy (used by up)

The contract and the spec's fields: cluster/README.md ("Topology launcher").
"""
import argparse
import asyncio
import base64
import fcntl
import http.client
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATE = "state.json"


class LaunchError(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# small helpers

def write_private(path, data):
    """Writes bytes to a new file created owner-only (0600) from the start."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def run(cmd, check=True):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and r.returncode != 0:
        raise LaunchError(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip()}")
    return r


def tail(path, n=20):
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            lines = f.read().decode("utf-8", "replace").splitlines()
        return "\n".join(lines[-n:])
    except OSError:
        return ""


def parse_rate(text):
    """'100mbit', '1gbit', '500kbit', '12mbps' (bytes) -> bits per second."""
    t = str(text).strip().lower()
    units = [("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("gbps", 8e9), ("mbps", 8e6),
             ("kbps", 8e3), ("bit", 1), ("bps", 8)]
    for u, mul in units:
        if t.endswith(u):
            return int(float(t[: -len(u)]) * mul)
    return int(float(t))


def proc_starttime(pid):
    """Start time (clock ticks since boot) of pid, or None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    fields = s[s.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def alive(comp):
    pid, st = comp.get("pid"), comp.get("starttime")
    return pid is not None and st is not None and proc_starttime(pid) == st


def http_get(host, port, path, timeout=2.0):
    c = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read().decode("utf-8", "replace")
    finally:
        c.close()


def tcp_accepts(host, port, timeout=1.0):
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def redis_ping(host, port, password, timeout=1.0):
    """AUTH + PING in RESP; True on +PONG."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            def cmd(*args):
                out = f"*{len(args)}\r\n"
                for a in args:
                    out += f"${len(a.encode())}\r\n{a}\r\n"
                s.sendall(out.encode())
                buf = b""
                while not buf.endswith(b"\r\n"):
                    chunk = s.recv(256)
                    if not chunk:
                        break
                    buf += chunk
                return buf
            if password and not cmd("AUTH", password).startswith(b"+OK"):
                return False
            return cmd("PING").startswith(b"+PONG")
    except OSError:
        return False


def free_port(host="127.0.0.1"):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# state

class Run:
    def __init__(self, run_dir, state=None):
        self.dir = run_dir
        self.state = state if state is not None else {}

    @staticmethod
    def load(run_dir):
        path = os.path.join(run_dir, STATE)
        if not os.path.exists(path):
            raise LaunchError(f"{path}: no state file (not a run directory, or already removed)")
        with open(path) as f:
            return Run(run_dir, json.load(f))

    def save(self):
        tmp = os.path.join(self.dir, STATE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(self.state, f, indent=1)
        os.replace(tmp, os.path.join(self.dir, STATE))

    def comps(self):
        return self.state.setdefault("components", [])

    def find(self, name):
        for c in self.comps():
            if c["name"] == name:
                return c
        raise LaunchError(f"no component {name!r}; have {[c['name'] for c in self.comps()]}")


# ---------------------------------------------------------------------------------------------
# network namespaces

def subnet_in_use(net):
    used = run(["ip", "-4", "-o", "addr"]).stdout
    for line in used.splitlines():
        parts = line.split()
        if "inet" in parts:
            addr = parts[parts.index("inet") + 1].split("/")[0]
            if ipaddress.ip_address(addr) in net:
                return True
    return False


def pick_subnet():
    for n in range(1, 255):
        if not subnet_in_use(ipaddress.ip_network(f"10.211.{n}.0/24")):
            return f"10.211.{n}.0/24"
    raise LaunchError("no free 10.211.N.0/24 subnet")


def tbf(prefix, dev, link):
    rate = parse_rate(link["rate"])
    # burst: 20 ms at the rate, at least 32 KiB (a tbf burst under rate/HZ cannot reach the rate)
    burst = int(link.get("burst_bytes") or max(32768, rate // 8 // 50))
    latency = link.get("latency", "50ms")
    run(prefix + ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate}bit",
                  "burst", str(burst), "latency", latency])
    return {"rate_bit": rate, "burst_bytes": burst, "latency": latency}


def setup_bridge(r):
    net = ipaddress.ip_network(r.state["subnet"])
    hosts = list(net.hosts())
    br = r.state["bridge"]
    r.state["bridge_created"] = True
    r.save()
    run(["ip", "link", "add", br, "type", "bridge"])
    run(["ip", "addr", "add", f"{hosts[0]}/{net.prefixlen}", "dev", br])
    run(["ip", "link", "set", br, "up"])
    r.state["bridge_addr"] = str(hosts[0])


def setup_netns(r, comp, link):
    """One namespace for comp, a veth pair onto the bridge, an address, tc tbf both ways."""
    rid, k = r.state["run_id"], comp["slot"]
    ns, vh, vc = f"spx-{rid}-{comp['name']}", f"sx{rid}{k}h", f"sx{rid}{k}c"
    net = ipaddress.ip_network(r.state["subnet"])
    addr = str(list(net.hosts())[k + 1])
    comp.update(ns=ns, veth_host=vh, addr=addr)
    r.save()  # recorded before creation: `down` removes whatever part exists
    run(["ip", "netns", "add", ns])
    run(["ip", "link", "add", vh, "type", "veth", "peer", "name", vc])
    run(["ip", "link", "set", vc, "netns", ns])
    run(["ip", "-n", ns, "link", "set", vc, "name", "eth0"])
    run(["ip", "-n", ns, "addr", "add", f"{addr}/{net.prefixlen}", "dev", "eth0"])
    run(["ip", "-n", ns, "link", "set", "eth0", "up"])
    run(["ip", "-n", ns, "link", "set", "lo", "up"])
    run(["ip", "link", "set", vh, "master", r.state["bridge"]])
    run(["ip", "link", "set", vh, "up"])
    if link and link.get("rate"):
        shaped = tbf([], vh, link)                     # into the namespace
        tbf(["ip", "netns", "exec", ns], "eth0", link)  # out of it
        comp["link"] = shaped
    r.save()


# ---------------------------------------------------------------------------------------------
# processes

def start(r, comp, cmd, env=None):
    out = os.path.join(r.dir, f"{comp['name']}.out")
    err = os.path.join(r.dir, f"{comp['name']}.err")
    n = comp.get("restarts", 0)
    if n:  # a restart keeps the earlier process's logs as NAME.out.N / NAME.err.N
        for f in (out, err):
            if os.path.exists(f):
                os.replace(f, f"{f}.{n}")
    full = list(cmd)
    nice = int(r.state.get("nice", 0))
    if nice:
        full = ["nice", "-n", str(nice)] + full
    if comp.get("ns"):
        full = ["ip", "netns", "exec", comp["ns"]] + full
    e = dict(os.environ)
    e.update(env or {})
    with open(out, "wb") as fo, open(err, "wb") as fe:
        p = subprocess.Popen(full, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe, env=e,
                             start_new_session=True, cwd=r.dir)
    # `ip netns exec` and `nice` exec into the command: the pid stays the process's
    st = None
    for _ in range(50):
        st = proc_starttime(p.pid)
        if st is not None:
            break
        time.sleep(0.01)
    comp.update(pid=p.pid, starttime=st, cmd=full, argv=list(cmd), env=env or {}, stdout=out, stderr=err)
    r.save()
    return p


def fail(comp, what):
    raise LaunchError(f"{comp['name']}: {what}\n--- stderr tail ({comp.get('stderr')}) ---\n"
                      f"{tail(comp.get('stderr', ''))}\n--- stdout tail ---\n{tail(comp.get('stdout', ''))}")


def wait_port_line(comp, timeout):
    """The first stdout line's "port" (serve, router, kv-node print {"event":"listening","port":P})."""
    end = time.time() + timeout
    while time.time() < end:
        try:
            with open(comp["stdout"]) as f:
                line = f.readline()
            if line.endswith("\n"):
                return int(json.loads(line)["port"])
        except (OSError, ValueError, KeyError):
            pass
        if not alive(comp):
            fail(comp, "exited before listening")
        time.sleep(0.05)
    fail(comp, f"no listening line in {timeout} s")


def wait_healthy(r, comp, timeout):
    end = time.time() + timeout
    while time.time() < end:
        if not alive(comp):
            fail(comp, "exited during start-up")
        ok, _ = health(r, comp)
        if ok:
            return
        time.sleep(0.1)
    fail(comp, f"not healthy within {timeout} s")


def health(r, comp):
    """(healthy, detail) for one component: process alive and answering its check."""
    if not alive(comp):
        return False, "process not running"
    host, port = comp.get("addr"), comp.get("port")
    if port is None:
        return False, "no port yet"
    role = comp["role"]
    try:
        if role in ("replica", "router"):
            status, body = http_get(host, port, "/health")
            return status == 200, f"/health {status}"
        if role == "kv-node" or role == "proxy":
            return tcp_accepts(host, port), "accepts connections"
        if role == "store":
            with open(r.state["store_password_file"]) as f:
                pw = f.read()
            return redis_ping(host, port, pw), "PING"
    except (OSError, http.client.HTTPException) as e:
        return False, f"{type(e).__name__}: {e}"
    return False, "unknown role"


def add_comp(r, role, index):
    comp = {"name": f"{role}-{index}" if role in ("replica", "kv-node") else role,
            "role": role, "index": index, "slot": len(r.comps())}
    r.comps().append(comp)
    r.save()
    return comp


def place(r, comp, link):
    if r.state["mode"] == "netns":
        setup_netns(r, comp, link)
    else:
        comp["addr"] = "127.0.0.1"


def start_proxy(r, target, delay_ms, timeout):
    """A delaying proxy in the target's namespace, on the target's address; returns its port."""
    proxy = {"name": f"proxy-{target['name']}", "role": "proxy", "index": target["index"],
             "slot": target["slot"], "ns": target.get("ns"), "addr": target["addr"],
             "for": target["name"], "delay_ms": delay_ms}
    r.comps().append(proxy)
    start(r, proxy, [sys.executable, os.path.abspath(__file__), "proxy", "--listen",
                     f"{target['addr']}:0", "--target", f"{target['addr']}:{target['port']}",
                     "--delay-ms", str(delay_ms)])
    proxy["port"] = wait_port_line(proxy, timeout)
    wait_healthy(r, proxy, timeout)
    proxy["endpoint"] = f"{proxy['addr']}:{proxy['port']}"
    r.save()
    return proxy["port"]


def cmd_up(args):
    with open(args.spec) as f:
        spec = json.load(f)
    known = {"mode", "binary", "model", "serve_args", "replicas", "kv_nodes", "store", "router", "links",
             "delay_ms", "subnet", "nice", "startup_timeout_s"}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise LaunchError(f"{args.spec}: unknown field(s) {unknown}; known: {sorted(known)}")
    mode = spec.get("mode", "local")
    if mode not in ("local", "netns"):
        raise LaunchError(f"{args.spec}: mode {mode!r}: local or netns")
    if mode == "netns" and os.geteuid() != 0:
        raise LaunchError("mode netns needs root (ip netns, tc)")
    binary = os.path.abspath(spec.get("binary", os.path.join(ROOT, "build/release/bin/specontext")))
    model = os.path.abspath(spec.get("model", os.path.join(ROOT, "models/stories260K/stories260K.bin")))
    for p in (binary, model):
        if not os.path.exists(p):
            raise LaunchError(f"{args.spec}: {p} does not exist")
    replicas = int(spec.get("replicas", 1))
    if not 1 <= replicas <= 200:
        raise LaunchError(f"{args.spec}: replicas {replicas}: 1 to 200")
    kv = spec.get("kv_nodes") or {}
    kv_count = int(kv.get("count", 0))
    if not 0 <= kv_count <= 50:
        raise LaunchError(f"{args.spec}: kv_nodes.count {kv_count}: 0 to 50")
    store = spec.get("store") or {"type": "none"}
    if isinstance(store, str):
        store = {"type": store}
    if store.get("type", "none") not in ("redis", "none"):
        raise LaunchError(f"{args.spec}: store.type {store.get('type')!r}: redis or none")
    router = spec.get("router") or {}
    links = spec.get("links") or {}
    delay = spec.get("delay_ms") or {}
    timeout = float(spec.get("startup_timeout_s", 120))
    if mode == "local" and links.get("rate"):
        raise LaunchError(f"{args.spec}: links.rate needs mode netns (tc shapes veth links)")

    run_dir = args.run_dir or tempfile.mkdtemp(prefix="spx-cluster-")
    os.makedirs(run_dir, exist_ok=True)
    if os.path.exists(os.path.join(run_dir, STATE)):
        raise LaunchError(f"{run_dir}: already holds a run (down it first)")
    os.chmod(run_dir, 0o700)
    rid = secrets.token_hex(2)
    r = Run(os.path.abspath(run_dir), {"run_id": rid, "mode": mode, "spec": spec,
                                       "nice": spec.get("nice", 0), "components": []})
    t0 = time.time()

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)
    r.save()

    def link_for(role):
        if not links.get("rate") and not (links.get("roles") or {}).get(role):
            return None
        out = dict(links)
        over = (links.get("roles") or {}).get(role)
        if over:
            out["rate"] = over
        return out

    try:
        if mode == "netns":
            # subnet chosen and bridge addressed under one lock: concurrent `up`s pick different /24s
            with open("/run/spx-launch.lock" if os.path.isdir("/run") else "/tmp/spx-launch.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                r.state["bridge"] = f"spxbr{rid}"
                if spec.get("subnet"):
                    net = ipaddress.ip_network(spec["subnet"])
                    if net.num_addresses < 8 or subnet_in_use(net):
                        raise LaunchError(f"subnet {net}: in use here, or smaller than /29")
                    r.state["subnet"] = str(net)
                else:
                    r.state["subnet"] = pick_subnet()
                setup_bridge(r)
        ucx_env = {"UCX_NET_DEVICES": "eth0"} if mode == "netns" else {}

        # the store
        store_url = None
        if store.get("type") == "redis":
            comp = add_comp(r, "store", 0)
            place(r, comp, link_for("store"))
            pw = secrets.token_hex(24)
            pwfile = os.path.join(r.dir, "store.password")
            write_private(pwfile, pw.encode())
            r.state["store_password_file"] = pwfile
            comp["port"] = int(store.get("port", 6379 if mode == "netns" else free_port()))
            conf = os.path.join(r.dir, "redis.conf")
            write_private(conf, (f"bind {comp['addr']}\nport {comp['port']}\nrequirepass {pw}\n"
                                 f"save \"\"\nappendonly no\ndir {r.dir}\ndaemonize no\n"
                                 f"maxmemory {store.get('maxmemory', '256mb')}\n"
                                 f"maxmemory-policy allkeys-lru\n").encode())
            start(r, comp, [store.get("server", shutil.which("redis-server") or "redis-server"), conf])
            wait_healthy(r, comp, timeout)
            target_port = comp["port"]
            if delay.get("store"):
                target_port = start_proxy(r, comp, float(delay["store"]), timeout)
            store_url = f"redis://{comp['addr']}:{target_port}"
            comp["endpoint"] = store_url

        # KV nodes
        kv_eps = []
        if kv_count:
            secret = os.path.join(r.dir, "kv.secret")
            write_private(secret, base64.b64encode(os.urandom(32)) + b"\n")
            r.state["kv_secret_file"] = secret
        for i in range(kv_count):
            comp = add_comp(r, "kv-node", i)
            place(r, comp, link_for("kv-node"))
            start(r, comp, [binary, "kv-node", "--listen", f"{comp['addr']}:0", "--capacity",
                            str(kv.get("capacity", "64MiB")), "--secret-file", r.state["kv_secret_file"]]
                  + list(kv.get("args", [])), env=ucx_env)
            comp["port"] = wait_port_line(comp, timeout)
            wait_healthy(r, comp, timeout)
            comp["endpoint"] = f"{comp['addr']}:{comp['port']}"
            kv_eps.append(comp["endpoint"])
            r.save()

        # serve replicas
        serve_flags = ["-m", model] + list(spec.get("serve_args", []))
        if store_url:
            serve_flags += ["--prefix-store", store_url, "--prefix-store-password-file",
                            r.state["store_password_file"]]
        if kv_eps:
            use, size = kv.get("use", "tier"), str(kv.get("size", "1MiB"))
            if use == "tier":
                serve_flags += ["--kv-node", f"{size}@{'+'.join(kv_eps)}"]
            elif use == "prefix-offload":
                serve_flags += ["--prefix-offload-remote", f"{size}@{'+'.join(kv_eps)}"]
            else:
                raise LaunchError(f"{args.spec}: kv_nodes.use {use!r}: tier or prefix-offload")
            serve_flags += ["--kv-secret-file", r.state["kv_secret_file"]]
        replica_urls = []
        procs = []
        for i in range(replicas):  # started together, then each checked: loading overlaps
            comp = add_comp(r, "replica", i)
            place(r, comp, link_for("replica"))
            procs.append(comp)
            start(r, comp, [binary, "serve", "--listen", f"{comp['addr']}:0"] + serve_flags, env=ucx_env)
        for comp in procs:
            comp["port"] = wait_port_line(comp, timeout)
            r.save()
            wait_healthy(r, comp, timeout)
            port = comp["port"]
            if delay.get("replica"):
                port = start_proxy(r, comp, float(delay["replica"]), timeout)
            comp["endpoint"] = f"http://{comp['addr']}:{port}"
            replica_urls.append(comp["endpoint"])
            r.save()

        # the router
        comp = add_comp(r, "router", 0)
        place(r, comp, link_for("router"))
        rcmd = [binary, "router", "--host", comp["addr"], "--port", "0",
                "--policy", router.get("policy", "rr")] + list(router.get("args", []))
        for u in replica_urls:
            rcmd += ["--replica", u]
        start(r, comp, rcmd)
        comp["port"] = wait_port_line(comp, timeout)
        wait_healthy(r, comp, timeout)
        comp["endpoint"] = f"http://{comp['addr']}:{comp['port']}"
        r.state["startup_s"] = round(time.time() - t0, 3)
        r.state["up"] = True
        r.save()
    except BaseException as e:
        sys.stderr.write(f"up failed: {e}\ntearing down {r.dir}\n")
        teardown(r)
        raise SystemExit(1)
    print(json.dumps(endpoints(r)))


def endpoints(r):
    out = {"run_dir": r.dir, "mode": r.state["mode"], "startup_s": r.state.get("startup_s")}
    for c in r.comps():
        if c["role"] == "router":
            out["router"] = c.get("endpoint")
        elif c["role"] == "store":
            out["store"] = c.get("endpoint")
        elif c["role"] in ("replica", "kv-node"):
            out.setdefault(c["role"].replace("-", "_") + "s", []).append(c.get("endpoint"))
    if r.state["mode"] == "netns":
        out["namespaces"] = {c["name"]: c["ns"] for c in r.comps() if c["role"] != "proxy"}
        out["bridge"] = r.state.get("bridge")
        out["subnet"] = r.state.get("subnet")
    return out


# ---------------------------------------------------------------------------------------------
# down, kill, status

def stop(comp, grace):
    if not alive(comp):
        return False
    try:
        os.kill(comp["pid"], signal.SIGTERM)
    except ProcessLookupError:
        return False
    end = time.time() + grace
    while time.time() < end and alive(comp):
        time.sleep(0.05)
    if alive(comp):
        os.kill(comp["pid"], signal.SIGKILL)
        while alive(comp):
            time.sleep(0.02)
    return True


def teardown(r, grace=10.0):
    # router first (no new requests), replicas, proxies, then nodes and the store
    order = {"router": 0, "replica": 1, "proxy": 2, "kv-node": 3, "store": 4}
    for c in sorted(r.comps(), key=lambda c: order.get(c["role"], 9)):
        stop(c, grace)
    for c in r.comps():
        if c.get("veth_host"):
            run(["ip", "link", "del", c["veth_host"]], check=False)
        if c.get("ns"):
            run(["ip", "netns", "del", c["ns"]], check=False)
    if r.state.get("bridge_created"):
        run(["ip", "link", "del", r.state["bridge"]], check=False)
    r.state["up"] = False
    r.save()
    for name in ("kv.secret", "store.password", "redis.conf"):  # secrets go; logs and state stay
        try:
            os.unlink(os.path.join(r.dir, name))
        except FileNotFoundError:
            pass
    left = leftovers(r)
    if left:
        raise LaunchError(f"left behind: {left}")


def leftovers(r):
    left = [c["name"] for c in r.comps() if alive(c)]
    if r.state["mode"] == "netns":
        nss = {line.split()[0] for line in run(["ip", "netns", "list"]).stdout.splitlines() if line.strip()}
        links = run(["ip", "-o", "link"]).stdout
        left += [c["ns"] for c in r.comps() if c.get("ns") and c["ns"] in nss]
        left += [c["veth_host"] for c in r.comps() if c.get("veth_host") and f" {c['veth_host']}@" in links]
        if r.state.get("bridge") and f" {r.state['bridge']}:" in links:
            left.append(r.state["bridge"])
    return left


def cmd_down(args):
    try:
        r = Run.load(args.run_dir)
    except LaunchError as e:
        print(json.dumps({"down": True, "note": str(e)}))
        return
    teardown(r, args.grace)
    print(json.dumps({"down": True, "run_dir": r.dir}))


def cmd_kill(args):
    r = Run.load(args.run_dir)
    name = "-".join(args.component)
    c = r.find(name)
    sig = getattr(signal, "SIG" + args.signal.upper())
    if not alive(c):
        print(json.dumps({"killed": name, "note": "was not running"}))
        return
    os.kill(c["pid"], sig)
    end = time.time() + args.wait
    while time.time() < end and alive(c):
        time.sleep(0.02)
    c["killed_at"] = time.time()
    r.save()
    print(json.dumps({"killed": name, "signal": args.signal.upper(), "pid": c["pid"], "gone": not alive(c)}))


def cmd_restart(args):
    """Starts a killed component again at its address and port (a kv-node back at its address
    rejoins its mirrored tiers; the router health-checks a replica back)."""
    r = Run.load(args.run_dir)
    if not r.state.get("up"):
        raise LaunchError(f"{r.dir}: the run is not up")
    c = r.find("-".join(args.component))
    if alive(c):
        raise LaunchError(f"{c['name']} is running (kill it first)")
    argv = list(c["argv"])
    for i, a in enumerate(argv):
        if a == f"{c['addr']}:0":
            argv[i] = f"{c['addr']}:{c['port']}"
        if c["role"] == "router" and a == "--port" and argv[i + 1] == "0":
            argv[i + 1] = str(c["port"])
    c["restarts"] = c.get("restarts", 0) + 1
    start(r, c, argv, c.get("env"))
    timeout = float(r.state["spec"].get("startup_timeout_s", 120))
    try:
        if c["role"] != "store":
            port = wait_port_line(c, timeout)
            if port != c["port"]:
                raise LaunchError(f"{c['name']}: came back on port {port}, not {c['port']}")
        wait_healthy(r, c, timeout)
    except LaunchError:
        stop(c, 2.0)
        raise
    r.save()
    print(json.dumps({"restarted": c["name"], "pid": c["pid"], "endpoint": c.get("endpoint")}))


def cmd_status(args):
    r = Run.load(args.run_dir)
    rows, ok_all = [], True
    for c in r.comps():
        ok, detail = health(r, c)
        ok_all &= ok
        rows.append({"name": c["name"], "role": c["role"], "healthy": ok, "detail": detail,
                     "pid": c.get("pid"), "endpoint": c.get("endpoint") or
                     (f"{c.get('addr')}:{c.get('port')}" if c.get("port") else None)})
    print(json.dumps({"run_dir": r.dir, "healthy": ok_all, "components": rows}))
    return 0 if ok_all else 1


# ---------------------------------------------------------------------------------------------
# bandwidth: a bulk TCP transfer between two components' namespaces (or the root namespace)

SINK = r"""
import socket, sys, time, json
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 0)); s.listen(1); print(s.getsockname()[1], flush=True)
c, _ = s.accept(); n = 0; first = last = None
while True:
    b = c.recv(1 << 16)
    if not b: break
    now = time.monotonic(); first = first or now; last = now; n += len(b)
print(json.dumps({"bytes": n, "seconds": (last - first) if first else 0}), flush=True)
"""
SOURCE = r"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); buf = b"\0" * (1 << 16)
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end: c.sendall(buf)
c.close()
"""


def in_ns(comp_or_none, cmd):
    if comp_or_none and comp_or_none.get("ns"):
        return ["ip", "netns", "exec", comp_or_none["ns"]] + cmd
    return cmd


def cmd_bandwidth(args):
    r = Run.load(args.run_dir)
    src = None if args.src == "host" else r.find(args.src)
    dst = None if args.dst == "host" else r.find(args.dst)
    dst_addr = dst["addr"] if dst else (r.state.get("bridge_addr") or "127.0.0.1")
    sink = subprocess.Popen(in_ns(dst, [sys.executable, "-c", SINK, dst_addr]),
                            stdout=subprocess.PIPE, text=True)
    port = sink.stdout.readline().strip()
    subprocess.run(in_ns(src, [sys.executable, "-c", SOURCE, dst_addr, port, str(args.seconds)]),
                   check=True)
    res = json.loads(sink.stdout.readline())
    sink.wait()
    rate = res["bytes"] * 8 / res["seconds"] if res["seconds"] else 0
    out = {"src": args.src, "dst": args.dst, "bytes": res["bytes"], "seconds": round(res["seconds"], 3),
           "measured_bit_s": int(rate)}
    shaped = [c["link"]["rate_bit"] for c in (src, dst) if c and c.get("link")]
    if shaped:
        out["configured_bit_s"] = min(shaped)
        out["ratio"] = round(rate / min(shaped), 3)
    print(json.dumps(out))


# ---------------------------------------------------------------------------------------------
# the delaying proxy: every chunk is forwarded delay_ms after it arrived (each direction)

async def pump(reader, writer, delay):
    q = asyncio.Queue()

    async def recv():
        while True:
            b = await reader.read(1 << 16)
            await q.put((time.monotonic() + delay, b))
            if not b:
                return

    async def send():
        while True:
            due, b = await q.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not b:
                try:
                    writer.write_eof()
                except (OSError, RuntimeError):
                    pass
                return
            writer.write(b)
            await writer.drain()

    await asyncio.gather(recv(), send())


async def proxy_main(listen, target, delay):
    th, tp = target.rsplit(":", 1)

    async def handle(cr, cw):
        try:
            ur, uw = await asyncio.open_connection(th, int(tp))
        except OSError:
            cw.close()
            return
        try:
            await asyncio.gather(pump(cr, uw, delay), pump(ur, cw, delay))
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for w in (cw, uw):
                w.close()

    lh, lp = listen.rsplit(":", 1)
    server = await asyncio.start_server(handle, lh, int(lp))
    print(json.dumps({"event": "listening", "port": server.sockets[0].getsockname()[1],
                      "target": target, "delay_ms": delay * 1000}), flush=True)
    async with server:
        await server.serve_forever()


def cmd_proxy(args):
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    asyncio.run(proxy_main(args.listen, args.target, args.delay_ms / 1000.0))


# ---------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("up", help="start a topology from a JSON spec")
    p.add_argument("spec")
    p.add_argument("--run-dir", help="directory for state, logs, secrets (default: a new /tmp/spx-cluster-*)")
    p = sub.add_parser("down", help="kill everything, delete namespaces, links, bridge (idempotent)")
    p.add_argument("run_dir")
    p.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    p = sub.add_parser("status", help="health of every component")
    p.add_argument("run_dir")
    p = sub.add_parser("kill", help="kill one component: replica N | kv-node N | store | router")
    p.add_argument("run_dir")
    p.add_argument("component", nargs="+")
    p.add_argument("--signal", default="KILL", help="KILL (default) or TERM, INT, STOP, ...")
    p.add_argument("--wait", type=float, default=5.0, help="seconds to wait for it to go")
    p = sub.add_parser("restart", help="start a killed component again at its address and port")
    p.add_argument("run_dir")
    p.add_argument("component", nargs="+")
    p = sub.add_parser("bandwidth", help="bulk TCP SRC -> DST (component names or 'host')")
    p.add_argument("run_dir")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--seconds", type=float, default=3.0)
    p = sub.add_parser("proxy", help="delaying TCP proxy (started by up for delay_ms)")
    p.add_argument("--listen", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--delay-ms", type=float, required=True)
    args = ap.parse_args()
    try:
        rc = {"up": cmd_up, "down": cmd_down, "status": cmd_status, "kill": cmd_kill, "restart": cmd_restart,
              "bandwidth": cmd_bandwidth, "proxy": cmd_proxy}[args.cmd](args)
    except LaunchError as e:
        sys.stderr.write(f"error: {e}\n")
        return 1
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
