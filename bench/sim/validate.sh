#!/usr/bin/env bash
# One measured run for the simulator's validation (bench/RESULTS.md): N fresh `specontext serve`
# replicas of stories260K behind a fresh `specontext router`, bench_loadgen on a trace through the
# router (scraping the router and every replica), everything stopped after.
#   bench/sim/validate.sh REPLICAS POLICY TRACE OUT.json [extra bench_loadgen options]
set -euo pipefail
N=$1 POLICY=$2 TRACE=$3 OUT=$4; shift 4
BIN=${BIN:-build/release/bin/specontext}
LOADGEN=${LOADGEN:-build/release/bench/bench_loadgen}
MODEL=${MODEL:-models/stories260K/stories260K.bin}
dir=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT
. "$(dirname "${BASH_SOURCE[0]}")/port_of.sh"
replicas=() scrape=()
for i in $(seq "$N"); do
  nice -n 5 "$BIN" serve -m "$MODEL" --served-model-name stories --listen 127.0.0.1:0 --max-batch 8 \
    > "$dir/serve$i.out" 2> "$dir/serve$i.err" & pids+=($!)
  p=$(port_of "$dir/serve$i.out")
  replicas+=(--replica "http://127.0.0.1:$p") scrape+=(--scrape "127.0.0.1:$p")
done
nice -n 5 "$BIN" router "${replicas[@]}" --policy "$POLICY" --port 0 > "$dir/router.out" 2> "$dir/router.err" & pids+=($!)
rp=$(port_of "$dir/router.out")
nice -n 5 "$LOADGEN" --target "127.0.0.1:$rp" --trace "$TRACE" --model stories --scrape "127.0.0.1:$rp" "${scrape[@]}" \
  --out "$OUT" "$@" > /dev/null
