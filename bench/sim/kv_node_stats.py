#!/usr/bin/env python3
"""A `specontext kv-node`'s stats (its control plane's {"op":"stats"}) as one JSON line, for
bench/sim/cluster_run.sh: hello, then (a node with a shared secret) the HMAC answer of
cluster/kv_node_auth.cc (auth_response, "specontext kv-node auth v5"), then stats.
    kv_node_stats.py HOST:PORT [SECRET_FILE]
Prints {"error": ...} when the node does not answer (a dead node)."""
import hashlib
import hmac
import json
import os
import socket
import sys


def call(f, sock, obj):
    sock.sendall((json.dumps(obj) + "\n").encode())
    line = f.readline()
    if not line:
        raise OSError("the node closed the connection")
    return json.loads(line)


def main():
    host, port = sys.argv[1].rsplit(":", 1)
    secret = None
    if len(sys.argv) > 2:
        with open(sys.argv[2], "rb") as s:
            secret = s.read().rstrip(b" \t\r\n")
    try:
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            f = sock.makefile("r")
            hello = call(f, sock, {"op": "hello"})
            if hello.get("auth") == "hmac-sha256":
                if secret is None:
                    raise OSError("the node wants a secret")
                msg = bytes.fromhex(hello["nonce"]) + b"specontext kv-node auth v5\0" + hello["node"].encode()
                mac = hmac.new(secret, msg, hashlib.sha256).hexdigest()
                reply = call(f, sock, {"op": "auth", "mac": mac, "nonce": os.urandom(32).hex()})
                if reply.get("auth") != "done":
                    raise OSError("auth refused: " + json.dumps(reply)[:200])
            print(json.dumps(call(f, sock, {"op": "stats"})))
    except (OSError, ValueError, KeyError) as e:
        print(json.dumps({"error": str(e)}))


if __name__ == "__main__":
    main()
