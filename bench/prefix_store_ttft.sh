#!/usr/bin/env bash
# Time to first token of a long prompt through `specontext serve` (a streamed /v1/completions
# request, max_tokens 1, timed by the client from sending to the first chunk), three ways, each a
# fresh server process: without a shared store ("alone"); server A with --prefix-store, which
# computes the prompt and writes it to Redis when it finishes ("cold"); then server B, another
# process on the same store, which reads it back ("found"). A throwaway redis-server (password in
# a 0600 config, loopback, no persistence, allkeys-lru) runs in a temporary directory, stopped at
# the end. Synthetic weights (random; prompts are token ids): speed, not quality.
#   bench/prefix_store_ttft.sh
#   LENGTHS="1024 4096" REPS=2 MODEL_ARGS="--synthetic llama-3.2-1b --layers 4" bench/prefix_store_ttft.sh
# One JSON line per length and repetition (seconds), with each server's prefix-store counters.
set -euo pipefail
BIN=${BIN:-build/release/bin/specontext}
MODEL_ARGS=${MODEL_ARGS:---synthetic llama-3.2-1b --layers 4}
LENGTHS=${LENGTHS:-1024 4096}
REPS=${REPS:-2}
PORT=${PORT:-$((20000 + RANDOM % 20000))}
command -v redis-server >/dev/null || { echo "redis-server is not installed (apt-get install redis-server)" >&2; exit 1; }
dir=$(mktemp -d)
cleanup() {
  [ -f "$dir/serve.pid" ] && kill "$(cat "$dir/serve.pid")" 2>/dev/null || true
  [ -f "$dir/redis.pid" ] && kill "$(cat "$dir/redis.pid")" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
head -c 24 /dev/urandom | base64 > "$dir/password"
chmod 600 "$dir/password"
{
  echo "port $PORT"; echo "bind 127.0.0.1"; echo "requirepass $(cat "$dir/password")"; echo "dir $dir"
  echo "logfile $dir/redis.log"; echo 'save ""'; echo "appendonly no"; echo "maxmemory 4gb"
  echo "maxmemory-policy allkeys-lru"
} > "$dir/redis.conf"
chmod 600 "$dir/redis.conf"
redis-server "$dir/redis.conf" & echo $! > "$dir/redis.pid"
for _ in $(seq 100); do
  REDISCLI_AUTH=$(cat "$dir/password") redis-cli -p "$PORT" ping 2>/dev/null | grep -q PONG && break
  sleep 0.1
done
max_len=0
for n in $LENGTHS; do [ "$n" -gt "$max_len" ] && max_len=$n; done
# One request: a server started, the prompt sent (streamed, timed), the server stopped; prints
# {"ttft_s":..., "stopped": serve's counters}.
request() {  # seed length [store flags...]
  local seed=$1 n=$2; shift 2
  # shellcheck disable=SC2086
  "$BIN" serve $MODEL_ARGS --listen 127.0.0.1:0 --max-batch 1 --max-context $((max_len + 64)) "$@" \
    > "$dir/serve.out" 2> "$dir/serve.err" & echo $! > "$dir/serve.pid"
  python3 - "$dir/serve.out" "$seed" "$n" <<'PY'
import http.client, json, random, sys, time
out, seed, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for _ in range(6000):  # the listening line (model made, identity hashed)
    try:
        line = open(out).readline()
        if line.endswith("\n"):
            listening = json.loads(line)
            port, model = listening["port"], listening["model"]
            break
    except (OSError, ValueError, KeyError):
        pass
    time.sleep(0.05)
else:
    sys.exit("serve did not start")
rng = random.Random(seed)
prompt = "".join(" %d" % rng.randrange(1000, 30000) for _ in range(n))
body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True})
c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
t0 = time.perf_counter()
c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
r = c.getresponse()
assert r.status == 200, r.read()
first = None
while True:
    line = r.readline()
    if not line:
        break
    if first is None and line.startswith(b"data: {"):
        first = time.perf_counter() - t0
print(json.dumps({"ttft_s": first}))
PY
  kill -INT "$(cat "$dir/serve.pid")"
  wait "$(cat "$dir/serve.pid")" || true
  rm -f "$dir/serve.pid"
  python3 -c 'import json,sys
for l in open(sys.argv[1]):
    j = json.loads(l)
    if j.get("event") == "stopped": print(json.dumps(j))' "$dir/serve.out"
}
STORE=(--prefix-store "redis://127.0.0.1:$PORT" --prefix-store-password-file "$dir/password")
for n in $LENGTHS; do
  for rep in $(seq "$REPS"); do
    seed=$((n * 100 + rep))  # a prompt no earlier run wrote
    alone=$(request "$seed" "$n")
    cold=$(request "$seed" "$n" "${STORE[@]}")
    found=$(request "$seed" "$n" "${STORE[@]}")
    python3 - "$n" "$rep" "$alone" "$cold" "$found" <<'PY'
import json, sys
n, rep = int(sys.argv[1]), int(sys.argv[2])
def parse(text):
    lines = text.strip().splitlines()
    ttft = json.loads(lines[0])["ttft_s"]
    stopped = json.loads(lines[1]) if len(lines) > 1 else {}
    counts = stopped.get("counters", stopped)
    return ttft, counts
try:
    (a, _), (c, cc), (f, fc) = (parse(t) for t in sys.argv[3:6])
except (KeyError, ValueError, IndexError):
    sys.exit("unexpected output: %r" % (sys.argv[3:6],))
keys = ["prefix_shared_hits", "prefix_shared_misses", "prefix_shared_writes", "prefix_shared_bytes_read",
        "prefix_shared_bytes_written", "prefix_shared_errors", "cached_prompt_tokens"]
print(json.dumps({"prompt_tokens": n, "rep": rep, "ttft_alone_s": a, "ttft_cold_s": c, "ttft_found_s": f,
                  "cold": {k: cc.get(k) for k in keys}, "found": {k: fc.get(k) for k in keys}}))
PY
  done
done
