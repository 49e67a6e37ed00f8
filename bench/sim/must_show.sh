#!/usr/bin/env bash
# Issue #31's "must show" on this machine (bench/RESULTS.md): every run through
# bench/sim/cluster_run.sh, each with fresh processes, reports under OUT (default bench_out/i31).
#   bench/sim/must_show.sh traces    the validation's three traces (seed 1), as RESULTS.md made them
#   bench/sim/must_show.sh scaling   1 / 2 / 4 replicas rr, 4 prefix, 1 / 2 / 4 rr + shared store,
#                                    each trace twice, and bench_cluster_sim's prediction of each
#                                    (CONFIGS="4 rr,4 rr store" TRACES="sat" REPS="1 2": a subset;
#                                    SERVE_ARGS="--prefix-store-chunk 32" SIM_ARGS="--store-chunk-tokens 32":
#                                    serve's and the simulator's options)
#   bench/sim/must_show.sh faults    2 replicas (rr) + shared store + replica 1's evicted prefixes on
#                                    a mirrored kv-node pair: two runs without a fault, then kill -9
#                                    a replica, a kv-node, the store KILL_AFTER s in; texts compared
set -euo pipefail
OUT=${OUT:-bench_out/i31}
LOADGEN=${LOADGEN:-build/release/bench/bench_loadgen}
SIM=${SIM:-build/release/bench/bench_cluster_sim}
CAL=${CAL:-bench/sim/stories260k_2core_cpu.json}  # with cpu_per_request: --cpus 2 takes the other processes' CPU from the replicas
RUN=bench/sim/cluster_run.sh
mkdir -p "$OUT"
case ${1:-} in
  traces)
    C=(--turns 4 --prefixes 2 --prefix-words 32 --turn-words 8 --tool-words 24 --agent-fraction 0.5 --max-tokens 16 --seed 1)
    "$LOADGEN" --make-trace "$OUT/p10.jsonl" --arrival poisson --rate 10 --requests 120 --sessions 16 "${C[@]}"
    "$LOADGEN" --make-trace "$OUT/b16.jsonl" --arrival burst --burst-size 16 --rate 10 --requests 120 --sessions 16 "${C[@]}"
    "$LOADGEN" --make-trace "$OUT/sat.jsonl" --arrival poisson --rate 100 --requests 400 --sessions 64 "${C[@]}"
    ;;
  scaling)
    IFS=, read -ra cfgs <<< "${CONFIGS:-1 rr,2 rr,4 rr,4 prefix,1 rr store,2 rr store,4 rr store}"
    for cfg in "${cfgs[@]}"; do
      read -r n policy store <<< "$cfg"
      flag=() tag=""
      [ "$store" = store ] && { flag=(--store); tag=_store; }
      for t in ${TRACES:-p10 b16 sat}; do
        for rep in ${REPS:-1 2}; do
          name="$OUT/${t}_r${n}_${policy}${tag}_$rep"
          echo "== $name $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
          "$RUN" --replicas "$n" --policy "$policy" "${flag[@]}" "$OUT/$t.jsonl" "$name.json" 2>&1 | grep ' ok ' || true
        done
        "$SIM" --calibration "$CAL" --trace "$OUT/$t.jsonl" --replicas "$n" --policy "$policy" "${flag[@]}" \
          --cpus 2 --noise -1 --compare "$OUT/${t}_r${n}_${policy}${tag}_1.json" \
          --out "$OUT/${t}_r${n}_${policy}${tag}_pred.json" ${SIM_ARGS:-} > /dev/null 2>&1 || true
      done
    done
    ;;
  faults)
    # TAG names a variant, e.g. SERVE_ARGS="--sparse dense" TAG=_dense (SERVE_ARGS: cluster_run.sh)
    T=${TRACE:-p10} AFTER=${KILL_AFTER:-4} TAG=${TAG:-}
    # TOPO: cluster_run.sh's topology options; LOADGEN_ARGS: more bench_loadgen options (--time-scale 4)
    # shellcheck disable=SC2206
    common=(${TOPO:---replicas 2 --policy rr --store --kv-nodes})
    # shellcheck disable=SC2206
    lgargs=(${LOADGEN_ARGS:-})
    for name in ${FAULTS:-none_1 none_2 replica kv-node store}; do
      kill=()
      case $name in none_*) ;; *) kill=(--kill "$name" --kill-after "$AFTER") ;; esac
      echo "== fault $name $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
      KV_NODE_SIZE=${KV_NODE_SIZE:-16MiB} "$RUN" "${common[@]}" "${kill[@]}" --logs "$OUT/logs_${T}${TAG}_$name" \
        "$OUT/$T.jsonl" "$OUT/fault_${T}${TAG}_$name.json" --record-text "${lgargs[@]}" 2>&1 | grep -E ' ok |killed|starts at' | cut -c1-300 || true
      [ "$name" = none_1 ] || "$LOADGEN" --compare-texts "$OUT/fault_${T}${TAG}_none_1.json" \
        "$OUT/fault_${T}${TAG}_$name.json" > "$OUT/fault_${T}${TAG}_$name.compare.json" || true
      [ "$name" = none_1 ] || python3 -c 'import json,sys; c=json.load(open(sys.argv[1])); c.pop("different_indices"); print(json.dumps(c))' \
        "$OUT/fault_${T}${TAG}_$name.compare.json"
    done
    ;;
  *) echo "usage: $0 traces|scaling|faults" >&2; exit 1 ;;
esac
