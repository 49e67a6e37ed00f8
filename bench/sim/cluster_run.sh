#!/usr/bin/env bash
# One measured run of a small cluster on this machine (issue #31's "must show", bench/RESULTS.md):
# N fresh `specontext serve` replicas of stories260K behind a fresh `specontext router`,
# optionally sharing a throwaway Redis prefix store and/or each keeping its KV on a mirrored pair
# of `specontext kv-node`s, bench_loadgen on a trace through the router (scraping the router and
# every replica), optionally one process SIGKILLed mid-trace; everything it started stopped after.
#   bench/sim/cluster_run.sh [options] TRACE OUT.json [extra bench_loadgen options]
#     --replicas N          serve replicas (default 1)
#     --policy P            the router's rr | least-load | prefix (default rr)
#     --store               a shared Redis prefix store (redis-server on a free loopback port,
#                           requirepass from a 0600 file, no persistence, allkeys-lru)
#     --kv-nodes            a KV tier of replica 1 on two mirrored kv-nodes (shared secret in a 0600
#                           file): KV_USE=prefix (default) its evicted prefixes (--prefix-offload-remote
#                           KV_NODE_SIZE@A+B), KV_USE=layers its layers (--kv-node with KV_TIERS)
#     --kill WHAT           replica (replica 2: needs --replicas >= 2) | kv-node (the pair's second:
#                           needs --kv-nodes) | kv-node-a (the pair's first, which serves the reads)
#                           | store (needs --store): kill -9 after --kill-after s
#     --kill-after S        seconds after bench_loadgen starts (its first request: the trace's first
#                           arrival; default 4)
#     --logs DIR            keep every process's output there (default: deleted)
# Prints the kill's time; the report is OUT.json (with --kv-nodes, the nodes' stats before and after
# in OUT.json.kvnodes.jsonl, read by bench/sim/kv_node_stats.py), each process's CPU seconds over the
# trace in OUT.json.cpu.json (bench/sim/proc_cpu.py; bench/sim/README.md). Every process runs `nice -n 5`.
set -euo pipefail
N=1 POLICY=rr STORE=0 KVN=0 KILL="" KILL_AFTER=4 LOGS=""
while [ $# -gt 0 ]; do
  case $1 in
    --replicas) N=$2; shift 2 ;;
    --policy) POLICY=$2; shift 2 ;;
    --store) STORE=1; shift ;;
    --kv-nodes) KVN=1; shift ;;
    --kill) KILL=$2; shift 2 ;;
    --kill-after) KILL_AFTER=$2; shift 2 ;;
    --logs) LOGS=$2; shift 2 ;;
    --*) echo "unknown option $1" >&2; exit 1 ;;
    *) break ;;
  esac
done
TRACE=$1 OUT=$2; shift 2
BIN=${BIN:-build/release/bin/specontext}
LOADGEN=${LOADGEN:-build/release/bench/bench_loadgen}
MODEL=${MODEL:-models/stories260K/stories260K.bin}
SERVE_ARGS=${SERVE_ARGS:-}  # more serve options for every replica (e.g. --sparse dense)
KV_TIERS=${KV_TIERS:---device-kv 256KiB --host-kv 256KiB}
KV_NODE_SIZE=${KV_NODE_SIZE:-4MiB}
KV_USE=${KV_USE:-prefix}  # prefix: the pair holds replica 1's evicted prefixes (--prefix-offload-remote);
                          # layers: its KV layers (--kv-node with KV_TIERS)
case $KILL in
  "") ;;
  replica) [ "$N" -ge 2 ] || { echo "--kill replica needs --replicas >= 2" >&2; exit 1; } ;;
  kv-node|kv-node-a) [ "$KVN" = 1 ] || { echo "--kill $KILL needs --kv-nodes" >&2; exit 1; } ;;
  store) [ "$STORE" = 1 ] || { echo "--kill store needs --store" >&2; exit 1; } ;;
  *) echo "--kill: replica, kv-node, kv-node-a or store" >&2; exit 1 ;;
esac
dir=$(mktemp -d)
pids=() roles=()  # roles: ROLE=PID for OUT.json.cpu.json
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [ -n "$LOGS" ]; then mkdir -p "$LOGS"; cp "$dir"/*.out "$dir"/*.err "$dir"/*.log "$LOGS"/ 2>/dev/null || true; fi
  rm -rf "$dir"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
. "$(dirname "${BASH_SOURCE[0]}")/port_of.sh"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

store_args=()
if [ "$STORE" = 1 ]; then
  rport=$(free_port)
  head -c 24 /dev/urandom | base64 > "$dir/redis.password"
  chmod 600 "$dir/redis.password"
  {
    echo "port $rport"; echo "bind 127.0.0.1"; echo "requirepass $(cat "$dir/redis.password")"; echo "dir $dir"
    echo "logfile $dir/redis.log"; echo 'save ""'; echo "appendonly no"; echo "maxmemory 1gb"
    echo "maxmemory-policy allkeys-lru"
  } > "$dir/redis.conf"
  chmod 600 "$dir/redis.conf"
  nice -n 5 redis-server "$dir/redis.conf" & redis_pid=$!; pids+=("$redis_pid"); roles+=("redis=$redis_pid")
  for _ in $(seq 100); do
    REDISCLI_AUTH=$(cat "$dir/redis.password") redis-cli -p "$rport" ping 2>/dev/null | grep -q PONG && break
    sleep 0.1
  done
  store_args=(--prefix-store "redis://127.0.0.1:$rport" --prefix-store-password-file "$dir/redis.password")
fi

kv_args=()
if [ "$KVN" = 1 ]; then
  head -c 24 /dev/urandom | base64 > "$dir/kv.secret"
  chmod 600 "$dir/kv.secret"
  kv_eps=() kv_pids=()
  for k in a b; do
    nice -n 5 "$BIN" kv-node --capacity 64MiB --listen 127.0.0.1:0 --secret-file "$dir/kv.secret" \
      > "$dir/kvnode_$k.out" 2> "$dir/kvnode_$k.err" & pids+=($!)
    kv_pids+=($!) roles+=("kv_node_$k=$!")
    kv_eps+=("127.0.0.1:$(port_of "$dir/kvnode_$k.out")")
  done
  # shellcheck disable=SC2206
  if [ "$KV_USE" = prefix ]; then
    kv_args=(--prefix-offload-remote "$KV_NODE_SIZE@${kv_eps[0]}+${kv_eps[1]}" --kv-secret-file "$dir/kv.secret")
  else
    kv_args=($KV_TIERS --kv-node "$KV_NODE_SIZE@${kv_eps[0]}+${kv_eps[1]}" --kv-secret-file "$dir/kv.secret")
  fi
fi

replicas=() scrape=() serve_pids=()
for i in $(seq "$N"); do
  extra=("${store_args[@]}")
  [ "$i" = 1 ] && extra+=("${kv_args[@]}")
  nice -n 5 "$BIN" serve -m "$MODEL" --served-model-name stories --listen 127.0.0.1:0 --max-batch 8 $SERVE_ARGS "${extra[@]}" \
    > "$dir/serve$i.out" 2> "$dir/serve$i.err" & pids+=($!); serve_pids+=($!); roles+=("serve$i=$!")
  p=$(port_of "$dir/serve$i.out")
  replicas+=(--replica "http://127.0.0.1:$p") scrape+=(--scrape "127.0.0.1:$p")
done
nice -n 5 "$BIN" router "${replicas[@]}" --policy "$POLICY" --port 0 > "$dir/router.out" 2> "$dir/router.err" & pids+=($!); roles+=("router=$!")
rp=$(port_of "$dir/router.out")

kv_stats() {  # label: both kv-nodes' stats, one JSON line each, into OUT.kvnodes.jsonl
  for k in 0 1; do
    echo "{\"when\": \"$1\", \"node\": \"${kv_eps[$k]}\", \"stats\": $(python3 "$(dirname "$0")/kv_node_stats.py" "${kv_eps[$k]}" "$dir/kv.secret")}"
  done >> "$OUT.kvnodes.jsonl"
}
if [ "$KVN" = 1 ]; then rm -f "$OUT.kvnodes.jsonl"; kv_stats before; fi
if [ -n "$KILL" ]; then
  case $KILL in
    replica) victim=${serve_pids[1]} ;;
    kv-node) victim=${kv_pids[1]} ;;
    kv-node-a) victim=${kv_pids[0]} ;;
    store) victim=$redis_pid ;;
  esac
  ( sleep "$KILL_AFTER"; kill -9 "$victim" 2>/dev/null && echo "killed $KILL (pid $victim) at $(date -u +%T.%N) (${KILL_AFTER} s in)" ) &
  killer=$!
fi
echo "bench_loadgen starts at $(date -u +%T.%N)"
rc=0
CPU=$(dirname "${BASH_SOURCE[0]}")/proc_cpu.py
python3 "$CPU" snap "${roles[@]}" > "$dir/cpu_before.json"
timed=()  # bench_loadgen's own CPU (rusage): /usr/bin/time where there is one
[ -x /usr/bin/time ] && timed=(/usr/bin/time -f "%U %S %e" -o "$dir/loadgen.time")
"${timed[@]}" nice -n 5 "$LOADGEN" --target "127.0.0.1:$rp" --trace "$TRACE" --model stories --scrape "127.0.0.1:$rp" "${scrape[@]}" \
  --out "$OUT" "$@" > /dev/null || rc=$?
python3 "$CPU" snap "${roles[@]}" > "$dir/cpu_after.json"
python3 "$CPU" merge "$dir/cpu_before.json" "$dir/cpu_after.json" "$dir/loadgen.time" "$OUT.cpu.json" || true
[ -n "$KILL" ] && wait "$killer" 2>/dev/null || true
echo "bench_loadgen exit $rc"
# the nodes' counters (OUT.kvnodes.jsonl) and serve's own account of them (events on its stderr)
if [ "$KVN" = 1 ]; then kv_stats after; cat "$OUT.kvnodes.jsonl"; grep -h "kv-node" "$dir/serve1.err" | head -5 || true; fi
exit 0
