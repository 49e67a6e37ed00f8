#!/usr/bin/env bash
# The device check: run once, from the repository root, on a bare machine with one GPU (H200),
# CUDA, PyTorch and HF transformers and nothing else of ours; results go to $OUT.
#
#   bash bench/gpu/device_check.sh          (gpu/README.md, "Device check", gives the `run` call)
#
# (a) binaries: unpack .device-bundle/spx-device-bundle.tar.xz (scripts/make_device_bundle.sh,
#     made before the session) to /tmp and find cuBLAS there; without a bundle, try a source build
#     (it needs our Debian packages, which that machine lacks: it says so and goes on)
# (b) nvidia-smi; a probe that our binaries see the device
# (c) the GPU tests (every test_gpu_*, gtest JSON) and `specontext generate` CUDA vs CPU: these
#     have first claim on the time (up to TESTS_MAX_S, leaving BENCH_MIN_S for the benchmarks)
# (d) bench_gpu_copy   (e) bench_gpu_decode (ours, dense and SpeContext)   (f) hf_decode.py, in
#     the time the tests left; the decode grid and the host pool follow the machine: requests
#     1,8,32 on a card of >= 120 GiB (H200), 1,8,16 below (H100 80 GB: 32K x 32 is 128 GiB of KV),
#     and the pinned host pool at most MemAvailable minus the host model copy and a margin
# (g) $OUT/device_check.json combining everything, and a one-screen summary on stdout.
# Each step runs under its own timeout, so the whole script ends within 8 minutes even if a part
# hangs; a failing step is reported and the next one runs (set -u, not set -e).
# Results reach $OUT as they come: tests.json after every test binary, the benchmarks write
# their JSON there after every configuration, and device_check.json (the summary) is rewritten
# after every stage, so a run cut off from outside still returns what it measured.
# $OUT receives at most 8 files (the device tool's limit): device_check.log, nvidia-smi.txt,
# tests.log, tests.json, gpu_copy.json, gpu_decode.json, hf_decode.json, device_check.json.
# Everything else is written under /tmp/spx-devcheck.
set -u

START=$(date +%s)
LIMIT_S=${DEVCHECK_LIMIT_S:-445}  # the steps; the summary and kill graces stay within 480 s
TESTS_MAX_S=${DEVCHECK_TESTS_MAX_S:-270}  # the tests' share at most (they go first)
BENCH_MIN_S=${DEVCHECK_BENCH_MIN_S:-90}   # kept for the benchmarks whatever the tests need
LAST_S=0
DEADLINE=$((START + LIMIT_S))
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT" || exit 1
if [ -z "${OUT:-}" ]; then
  OUT=/tmp/spx-devcheck-out
  echo "OUT is not set: writing to $OUT"
fi
mkdir -p "$OUT"
WORK=/tmp/spx-devcheck
rm -rf "$WORK"
mkdir -p "$WORK/gtest" "$WORK/smoke"
LOG="$OUT/device_check.log"
: >"$LOG"
: >"$OUT/tests.log"
STEPS="$WORK/steps.tsv"
: >"$STEPS"
export PYTHONUNBUFFERED=1
# No network on the device machine: the HF baseline builds its model from a config, and must not
# stall on hub look-ups.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export SPECONTEXT_SOURCE_DIR="$ROOT"  # the tests find models/ here, not at the build's path

say() { printf '%s\n' "$*" | tee -a "$LOG"; }
now() { date +%s; }
# record STEP STATUS SECONDS NOTE -> one line of steps.tsv (read by the summary)
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$(printf '%s' "$4" | tr '\t\n' '  ')" >>"$STEPS"; }
# limit WANT RESERVE: WANT seconds, or less when the deadline minus what later steps need is closer
limit() {
  local left=$((DEADLINE - $(now) - $2))
  if [ "$1" -lt "$left" ]; then echo "$1"; else echo "$left"; fi
}
# run NAME SECONDS LOGFILE CMD...: CMD under timeout (TERM, KILL 5 s later), output to LOGFILE.
run() {
  local name=$1 secs=$2 logf=$3 t0 rc
  shift 3
  if [ "$secs" -lt 3 ]; then
    say "[$name] skipped: no time left before the deadline"
    record "$name" skipped 0 "no time left"
    return 125
  fi
  t0=$(now)
  timeout -k 5 "$secs" "$@" >>"$logf" 2>&1
  rc=$?
  LAST_S=$(($(now) - t0))
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    say "[$name] TIMED OUT after ${LAST_S} s (limit $secs s); last lines:"
    tail -n 5 "$logf" | cut -c1-200 | sed 's/^/    /' | tee -a "$LOG"
    record "$name" timeout "$LAST_S" "limit $secs s"
  elif [ "$rc" -ne 0 ]; then
    say "[$name] FAILED rc=$rc after ${LAST_S} s; last lines:"
    tail -n 5 "$logf" | cut -c1-200 | sed 's/^/    /' | tee -a "$LOG"
    record "$name" "failed rc=$rc" "$LAST_S" ""
  else
    record "$name" ok "$LAST_S" ""
  fi
  return "$rc"
}
# append FILE TITLE: a step's full output into the log (not onto stdout)
append() {
  { echo "----- $2 -----"; tail -c 4000000 "$1"; echo; } >>"$LOG" 2>/dev/null
}
PROBE_OK=0
HAVE_BIN=0
GPU_LINE=""
# summarize [quiet]: $OUT/device_check.json from what is there so far (after every stage); without
# quiet, also the one-screen summary on stdout and in the log.
summarize() {
  local mode=${1:-print}
  if [ "$mode" = quiet ]; then
    timeout 30 python3 - "$OUT" "$WORK" "$STEPS" "$(($(now) - START))" "${GPU_LINE:-}" "$PROBE_OK" "$HAVE_BIN" quiet \
      <"$WORK/summary.py" >>"$WORK/summary.log" 2>&1 || say "[summary] could not write device_check.json"
  else
    timeout 30 python3 - "$OUT" "$WORK" "$STEPS" "$(($(now) - START))" "${GPU_LINE:-}" "$PROBE_OK" "$HAVE_BIN" print \
      <"$WORK/summary.py" 2>&1 | tee -a "$LOG"
  fi
}
cat >"$WORK/summary.py" <<'EOF'
import json, os, sys
out, work, steps_path, elapsed, gpu_line, probe_ok, have_bin = sys.argv[1:8]
quiet = sys.argv[8] == "quiet"

def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except Exception as e:
        return {"missing": "%s: %s" % (os.path.basename(path), e)}

steps = []
for line in open(steps_path):
    parts = line.rstrip("\n").split("\t")
    if len(parts) >= 3:
        steps.append({"step": parts[0], "status": parts[1], "seconds": int(parts[2] or 0),
                      "note": parts[3] if len(parts) > 3 else ""})
tests = load(os.path.join(out, "tests.json"))
copy = load(os.path.join(out, "gpu_copy.json"))
ours = load(os.path.join(out, "gpu_decode.json"))
hf = load(os.path.join(out, "hf_decode.json"))

test_rows = []
for name, g in sorted((tests.get("gtest") or {}).items()):
    passed = failed = skipped = 0
    failures = []
    for suite in g.get("testsuites", []):
        for t in suite.get("testsuite", []):
            if t.get("failures"):
                failed += 1
                failures.append(suite.get("name", "") + "." + t.get("name", ""))
            elif t.get("result") == "SKIPPED" or t.get("status") == "NOTRUN":
                skipped += 1
            else:
                passed += 1
    test_rows.append({"binary": name, "passed": passed, "failed": failed, "skipped": skipped,
                      "failures": failures[:20]})
ran = {r["binary"] for r in test_rows}
for s in steps:
    if s["step"].startswith("test_gpu_") and s["step"] not in ran:
        test_rows.append({"binary": s["step"], "passed": 0, "failed": 0, "skipped": 0,
                          "failures": ["no gtest JSON: " + s["status"]]})

gen = tests.get("generate") or {}
smoke = {}
for method in ("dense", "specontext"):
    a, b = gen.get("cuda-" + method), gen.get("cpu-" + method)
    if not a or not b or "text" not in a or "text" not in b:
        smoke[method] = "not run or failed"
    elif a.get("backend") != "cuda":
        smoke[method] = "CUDA run fell back to %s" % a.get("backend")
    else:
        ta, tb = a["text"], b["text"]
        n = 0
        while n < min(len(ta), len(tb)) and ta[n] == tb[n]:
            n += 1
        smoke[method] = ("same text (%d chars)" % len(ta) if ta == tb else
                         "texts differ after %d of %d chars" % (n, max(len(ta), len(tb))))

table = {}
for src, doc in (("ours", ours), ("hf", hf)):
    for c in doc.get("configs", []) or []:
        key = (c.get("ctx"), c.get("requests"))
        col = c.get("method") if src == "ours" else "hf-eager"
        table.setdefault(key, {})[col] = c

def cell(c):
    if not c:
        return "-"
    st = c.get("status")
    if st == "ok":
        v = "%.1f" % c["tokens_per_s"]
        if c.get("placement", {}).get("layers_offloaded"):
            v += "*"
        if c.get("stopped_early"):
            v += "~"
        return v
    return {"does not fit": "no fit", "skipped": "skipped", "OOM": "OOM"}.get(st, "error")

summary = {
    "elapsed_seconds": int(elapsed),
    "gpu": gpu_line,
    "our_binaries": bool(int(have_bin)),
    "our_programs_see_device": bool(int(probe_ok)),
    "steps": steps,
    "tests": test_rows,
    "generate_cuda_vs_cpu": smoke,
    "copy": {k: copy.get(k) for k in ("device", "peak", "suggested_gather_below_bytes", "default_gather_below_bytes", "missing") if k in copy},
    "decode": [dict(ctx=k[0], requests=k[1], **{m: (v.get("tokens_per_s") if v.get("status") == "ok" else v.get("status"))
                                               for m, v in cols.items()})
               for k, cols in sorted(table.items(), key=lambda kv: (kv[0][0] or 0, kv[0][1] or 0))],
    "versions": {k: hf.get(k) for k in ("torch", "torch_cuda", "transformers", "python") if k in hf},
    "ours_status": ours.get("status") or ours.get("missing"),
    "hf_status": hf.get("status") or hf.get("missing"),
    "files": sorted(set(os.listdir(out)) | {"device_check.json"}),
}
with open(os.path.join(out, "device_check.json"), "w") as f:
    json.dump({"summary": summary, "gpu_decode": ours, "hf_decode": hf, "gpu_copy": copy}, f, indent=1)
if quiet:
    sys.exit(0)

print("== SUMMARY (%s s) %s" % (elapsed, gpu_line or "no GPU reported by nvidia-smi"))
bad = [s for s in steps if s["status"] not in ("ok",)]
print("steps: %d ok, %d not ok%s" % (len(steps) - len(bad), len(bad),
      "".join("\n  %-28s %s (%s s) %s" % (s["step"], s["status"], s["seconds"], s["note"]) for s in bad)))
print("our programs see the device: %s" % ("yes" if int(probe_ok) else "NO"))
print("tests:")
for r in test_rows:
    print("  %-36s %4d passed %3d failed %3d skipped%s" % (r["binary"], r["passed"], r["failed"], r["skipped"],
          ("  <- " + ", ".join(r["failures"][:3])) if r["failures"] else ""))
print("generate stories260K, CUDA vs CPU: dense: %s; specontext: %s" % (smoke.get("dense"), smoke.get("specontext")))
if "peak" in copy:
    print("copy: H2D %.1f GB/s, D2H %.1f GB/s; DMA wins from %s B rows (default threshold %s B)" % (
        copy["peak"].get("h2d_gb_per_s", 0), copy["peak"].get("d2h_gb_per_s", 0),
        copy.get("suggested_gather_below_bytes"), copy.get("default_gather_below_bytes")))
else:
    print("copy: no figures (%s)" % copy.get("missing", "no peak in gpu_copy.json"))
print("decode tokens/s, %s bf16, %s KV, 32 steps (* = KV tiers used, ~ = fewer steps; ours: %s, HF: %s)" % (
    (ours.get("model") or {}).get("name", "llama-3.1-8b"), ours.get("kv_dtype", "?"), summary["ours_status"],
    summary["hf_status"]))
print("  %6s %4s %12s %12s %12s %9s %9s" % ("ctx", "R", "dense", "specontext", "hf-eager", "spec/dense", "spec/hf"))
for (ctx, r), cols in sorted(table.items(), key=lambda kv: (kv[0][0] or 0, kv[0][1] or 0)):
    d, s, h = cols.get("dense"), cols.get("specontext"), cols.get("hf-eager")
    def ratio(a, b):
        if a and b and a.get("status") == "ok" and b.get("status") == "ok" and b["tokens_per_s"] > 0:
            return "%.2f" % (a["tokens_per_s"] / b["tokens_per_s"])
        return "-"
    print("  %6s %4s %12s %12s %12s %9s %9s" % (ctx, r, cell(d), cell(s), cell(h), ratio(s, d), ratio(s, h)))
for src, doc in (("ours", ours), ("hf", hf)):
    for c in doc.get("configs", []) or []:
        if c.get("status") not in ("ok", "skipped"):
            why = c.get("error") or c.get("reason") or ""
            print("  %s ctx %s R %s %s: %s: %.150s" % (src, c.get("ctx"), c.get("requests"), c.get("method"), c.get("status"), why))
if hf.get("versions") or hf.get("torch"):
    print("torch %s (CUDA %s), transformers %s" % (hf.get("torch"), hf.get("torch_cuda"), hf.get("transformers")))
print("files in $OUT: " + ", ".join(summary["files"]))
EOF

say "== SpeContext device check, $(date -u +%Y-%m-%dT%H:%M:%SZ), repo $ROOT, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
say "host: $(uname -m), $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo), $(ldd --version 2>&1 | sed -n 1p)"

# ---------------------------------------------------------------------------------------------
# (a) binaries
BUNDLE_TAR=.device-bundle/spx-device-bundle.tar.xz
B=/tmp/spx-bundle
OURLIB=""
HAVE_BIN=0
if [ -f "$BUNDLE_TAR" ]; then
  rm -rf "$B"
  mkdir -p "$B"
  # GNU tar needs the xz program for -J; python3's tarfile (lzma) serves where it is missing.
  if command -v xz >/dev/null 2>&1; then
    unpack=(tar -C "$B" -xJf "$BUNDLE_TAR")
  else
    unpack=(python3 -c 'import sys, tarfile
t = tarfile.open(sys.argv[1], "r:xz")
try:
    t.extractall(sys.argv[2], filter="tar")
except TypeError:
    t.extractall(sys.argv[2])' "$BUNDLE_TAR" "$B")
  fi
  if run unpack "$(limit 60 400)" "$WORK/unpack.log" "${unpack[@]}"; then
    HAVE_BIN=1
    OURLIB="$B/lib"
    say "[unpack] bundle unpacked in ${LAST_S} s: $(sed -n 's/^commit: //p' "$B/MANIFEST.txt"), $(find "$B/bin" -type f | wc -l) programs"
    sed -n '1,6p' "$B/MANIFEST.txt" >>"$LOG"
  fi
else
  say "[build] no $BUNDLE_TAR: building from source. This needs our Debian packages (oneDNN, oneTBB, hwloc,"
  say "        CLI11, nlohmann-json, GoogleTest, PCRE2), which the device image does not have: expect the"
  say "        configure step to fail; the HF part runs regardless. Make the bundle first (scripts/make_device_bundle.sh)."
  BUILD=build/devcheck
  if run configure "$(limit 60 400)" "$WORK/build.log" cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DSPECONTEXT_CUDA=ON -DSPECONTEXT_NCCL=OFF -DSPECONTEXT_UCX=OFF -DCMAKE_CUDA_ARCHITECTURES=90; then
    targets=(specontext bench_gpu_decode bench_gpu_copy)
    for src in tests/gpu/*_test.cc; do targets+=("test_gpu_$(basename "$src" .cc)"); done
    if run build "$(limit 200 300)" "$WORK/build.log" cmake --build "$BUILD" -j "$(nproc)" --target "${targets[@]}"; then
      HAVE_BIN=1
      rm -rf "$B"
      mkdir -p "$B/bin"
      ln -s "$ROOT/$BUILD/bin/specontext" "$B/bin/specontext"
      for f in "$ROOT/$BUILD"/bench/gpu/bench_gpu_* "$ROOT/$BUILD"/tests/test_gpu_*; do
        [ -x "$f" ] && [ -f "$f" ] && ln -s "$f" "$B/bin/$(basename "$f")"
      done
    fi
  fi
  append "$WORK/build.log" "source build"
  [ "$HAVE_BIN" -eq 1 ] || say "[build] no binaries: our tests and benchmarks are skipped"
fi

# cuBLAS (libcublas.so.13, libcublasLt.so.13): the toolkit's, else PyTorch's nvidia-cublas wheel.
# Our programs do not link it: gpu/cublas_loader.cc dlopens it by soname, so LD_LIBRARY_PATH below
# is how they find it (ldd below no longer lists it).
find_lib_dir() {
  local name=$1 d
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-13*/lib64 \
    /usr/local/cuda-13*/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu; do
    if [ -e "$d/$name" ]; then
      echo "$d"
      return 0
    fi
  done
  d=$(timeout 30 python3 - "$name" 2>/dev/null <<'EOF'
import glob, os, site, sys
name = sys.argv[1]
roots = []
try:
    roots += site.getsitepackages()
except Exception:
    pass
roots += [p for p in sys.path if p.endswith("-packages")]
for r in dict.fromkeys(roots):
    for pattern in ("nvidia/cublas/lib/", "nvidia/cu13/lib/", "nvidia/*/lib/", "nvidia/**/"):
        hits = sorted(glob.glob(os.path.join(r, pattern + name), recursive=True))
        if hits:
            print(os.path.dirname(hits[0]))
            sys.exit(0)
EOF
  )
  if [ -n "$d" ]; then
    echo "$d"
    return 0
  fi
  d=$(ldconfig -p 2>/dev/null | awk -v n="$name" '$1 == n {print $NF; exit}')
  if [ -n "$d" ]; then
    dirname "$d"
    return 0
  fi
  return 1
}
CUBLAS_DIRS=""
for lib in libcublas.so.13 libcublasLt.so.13; do
  if d=$(find_lib_dir "$lib"); then
    case ":$CUBLAS_DIRS:" in *":$d:"*) ;; *) CUBLAS_DIRS="${CUBLAS_DIRS:+$CUBLAS_DIRS:}$d" ;; esac
  else
    say "[libs] $lib not found (toolkit, pip nvidia-cublas, ldconfig): our CUDA backend will report \"no cuBLAS\" (it opens cuBLAS at run time)"
  fi
done
# Our libraries and cuBLAS first, for our programs only (python3 keeps its own environment).
OURLD="${OURLIB:+$OURLIB:}${CUBLAS_DIRS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
unresolved() { env LD_LIBRARY_PATH="$OURLD" ldd "$B/bin/bench_gpu_decode" 2>&1 | grep 'not found' || true; }
if [ "$HAVE_BIN" -eq 1 ]; then
  missing=$(unresolved)
  # The bundle's libstdc++ / libgcc_s only when the system's lack a version our programs use.
  if [ -n "$missing" ] && [ -d "$B/lib-cxx" ]; then
    say "[libs] with the system's libstdc++: $(printf '%s' "$missing" | tr -s ' \t\n' ' ' | cut -c1-200); adding the bundle's lib-cxx"
    OURLD="$OURLIB:$B/lib-cxx:${OURLD#"$OURLIB":}"
    missing=$(unresolved)
  fi
  if [ -n "$missing" ]; then
    say "[libs] bench_gpu_decode does not resolve:"
    printf '%s\n' "$missing" | sed 's/^/    /' | tee -a "$LOG"
  fi
fi
say "[libs] cuBLAS from ${CUBLAS_DIRS:-nowhere}; LD_LIBRARY_PATH for our programs: $OURLD"

# ---------------------------------------------------------------------------------------------
# (b) the device
run nvidia-smi 20 "$OUT/nvidia-smi.txt" nvidia-smi
GPU_LINE=$(timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)
say "[nvidia-smi] ${GPU_LINE:-no GPU reported}"
PROBE_OK=0
probe() {
  rm -f "$WORK/probe.json"
  run probe 30 "$WORK/probe.log" env LD_LIBRARY_PATH="$OURLD" "$B/bin/bench_gpu_decode" --model toy --contexts 64 \
    --requests 1 --methods dense --steps 2 --out "$WORK/probe.json"
  python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); sys.exit(0 if d.get("figures_produced") else 1)' \
    "$WORK/probe.json" 2>/dev/null
}
if [ "$HAVE_BIN" -eq 1 ]; then
  if probe; then
    PROBE_OK=1
  elif [ -e /usr/local/nvidia/lib64/libcuda.so.1 ] && [[ ":$OURLD:" != *":/usr/local/nvidia/lib64:"* ]]; then
    say "[probe] our programs see no device; retrying with /usr/local/nvidia/lib64 (libcuda.so.1) on the path"
    OURLD="$OURLD:/usr/local/nvidia/lib64"
    if probe; then PROBE_OK=1; fi
  fi
  if [ "$PROBE_OK" -eq 1 ]; then
    say "[probe] our programs see the device (toy model decoded on CUDA)"
  else
    record probe-device "no device" 0 "our programs see no CUDA device"
    say "[probe] our programs DO NOT see a CUDA device: $(sed -n 's/.*"reason": "\(.*\)".*/\1/p' "$WORK/probe.json" 2>/dev/null | head -1)"
    say "        every device test will skip with \"no CUDA device\"; that is a failure of this check, not a pass"
  fi
  append "$WORK/probe.log" "probe (bench_gpu_decode --model toy)"
fi

# ---------------------------------------------------------------------------------------------
# (c) tests: device tests first, then the host-side ones; then generate CUDA vs CPU. They have
# first claim on the time; tests.json is rewritten after each binary.
write_tests_json() {
  timeout 30 python3 - "$WORK" "$OUT/tests.json" <<'EOF' || say "[tests] could not write tests.json"
import glob, json, os, sys
work, out = sys.argv[1], sys.argv[2]
doc = {"gtest": {}, "generate": {}}
for path in sorted(glob.glob(os.path.join(work, "gtest", "*.json"))):
    name = os.path.basename(path)[:-5]
    try:
        doc["gtest"][name] = json.load(open(path))
    except Exception as e:
        doc["gtest"][name] = {"error": "unreadable gtest JSON: %s" % e}
for path in sorted(glob.glob(os.path.join(work, "smoke", "*.json"))):
    name = os.path.basename(path)[:-5]
    res = None
    for line in open(path, errors="replace"):
        line = line.strip()
        if line.startswith("{"):
            try:
                res = json.loads(line)
            except ValueError:
                pass
    doc["generate"][name] = res if res is not None else {"error": "no JSON line in the output"}
# Written in place: a temporary file beside it could be left in $OUT as a ninth file.
with open(out, "w") as f:
    json.dump(doc, f, indent=1)
EOF
}
if [ "$HAVE_BIN" -eq 1 ]; then
  TESTS_END=$(($(now) + $(limit "$TESTS_MAX_S" "$BENCH_MIN_S")))
  # The suites that never ran on a device first (the pending-work checks are quick).
  order=(cuda_device cuda_pending_work cuda_retrieval cuda_sampling cuda_transport cuda_ops cuda_quant cuda_engine)
  listed=" "
  tests=()
  for n in "${order[@]}"; do
    if [ -x "$B/bin/test_gpu_${n}_test" ]; then
      tests+=("test_gpu_${n}_test")
      listed+="test_gpu_${n}_test "
    fi
  done
  for f in "$B"/bin/test_gpu_*; do
    n=$(basename "$f")
    [[ "$listed" == *" $n "* ]] || tests+=("$n")
  done
  for t in "${tests[@]}"; do
    left=$((TESTS_END - $(now) - 20))  # 20 s kept for the generate comparison
    secs=$((left < 90 ? left : 90))
    echo "===== $t" >>"$OUT/tests.log"
    run "$t" "$secs" "$OUT/tests.log" env LD_LIBRARY_PATH="$OURLD" "$B/bin/$t" --gtest_output="json:$WORK/gtest/$t.json"
    rc=$?
    [ "$rc" -eq 0 ] && say "[$t] ok (${LAST_S} s)"
    echo "===== $t rc=$rc" >>"$OUT/tests.log"
    write_tests_json
  done
  # The CLI end to end: greedy text of stories260K on CUDA and on the CPU, dense and SpeContext.
  for method in dense specontext; do
    for be in cuda cpu; do
      left=$((TESTS_END - $(now)))
      secs=$((left < 15 ? left : 15))
      echo "===== generate --backend $be --sparse $method" >>"$OUT/tests.log"
      run "generate-$be-$method" "$secs" "$WORK/smoke/$be-$method.json" env LD_LIBRARY_PATH="$OURLD" \
        "$B/bin/specontext" generate -m models/stories260K/stories260K.bin -p "Once upon a time" -n 200 \
        --sparse "$method" --backend "$be" --json
      cat "$WORK/smoke/$be-$method.json" >>"$OUT/tests.log"
    done
  done
  write_tests_json
  summarize quiet
fi

# ---------------------------------------------------------------------------------------------
# (d) copy rates, (e) our decode, (f) HF decode, in the time the tests left: copy up to 30 s,
# then ours about 55 % of the rest, HF what remains. The grid follows the card's memory, the
# host pool the machine's.
GPU_MIB=$(timeout 20 nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1 | tr -dc '0-9')
GPU_MIB=${GPU_MIB:-0}
if [ "$GPU_MIB" -ge $((120 * 1024)) ]; then
  REQUESTS=1,8,32
else
  REQUESTS=1,8,16
fi
# Pinned host KV pool: what the kernel reports available, less the host copy of the model's
# weights (15 GiB) and 16 GiB for everything else; at most 96 GiB, none when that leaves nothing.
AVAIL_GIB=$(awk '/^MemAvailable:/ {printf "%d", $2 / 1048576}' /proc/meminfo 2>/dev/null)
AVAIL_GIB=${AVAIL_GIB:-0}
HOST_KV_GIB=$((AVAIL_GIB - 15 - 16))
[ "$HOST_KV_GIB" -gt 96 ] && HOST_KV_GIB=96
[ "$HOST_KV_GIB" -lt 0 ] && HOST_KV_GIB=0
say "[grid] card ${GPU_MIB} MiB: contexts 16384,32768 x requests $REQUESTS; host ${AVAIL_GIB} GiB available: host KV pool at most ${HOST_KV_GIB} GiB"
if [ "$HAVE_BIN" -eq 1 ]; then
  run bench_gpu_copy "$(limit 30 60)" "$WORK/gpu_copy.log" env LD_LIBRARY_PATH="$OURLD" "$B/bin/bench_gpu_copy" \
    --out "$OUT/gpu_copy.json" --rows 1024,4096,16384,65536 --reps 2 --max-case-mib 256 && say "[bench_gpu_copy] ok (${LAST_S} s)"
  append "$WORK/gpu_copy.log" "bench_gpu_copy"
  summarize quiet

  left=$((DEADLINE - $(now) - 5))
  secs=$(limit $((left * 55 / 100)) 20)
  run bench_gpu_decode "$secs" "$WORK/gpu_decode.log" env LD_LIBRARY_PATH="$OURLD" "$B/bin/bench_gpu_decode" \
    --out "$OUT/gpu_decode.json" --contexts 16384,32768 --requests "$REQUESTS" --methods dense,specontext --steps 32 \
    --kv-dtype bf16 --host-kv-max-gib "$HOST_KV_GIB" --time-budget-s $((secs > 60 ? secs - 40 : secs / 2)) &&
    say "[bench_gpu_decode] ok (${LAST_S} s)"
  grep -E '^(ctx|bench_gpu_decode)' "$WORK/gpu_decode.log" | cut -c1-160 | tee -a "$LOG"
  append "$WORK/gpu_decode.log" "bench_gpu_decode"
  summarize quiet
fi

secs=$(limit 140 5)
run hf_decode "$secs" "$WORK/hf_decode.log" python3 bench/gpu/hf_decode.py --out "$OUT/hf_decode.json" \
  --contexts 16384,32768 --requests "$REQUESTS" --steps 32 --time-budget-s $((secs > 60 ? secs - 30 : secs / 2)) &&
  say "[hf_decode] ok (${LAST_S} s)"
grep -E '^hf_decode: (ctx|model|torch|no )' "$WORK/hf_decode.log" | cut -c1-160 | tee -a "$LOG"
append "$WORK/hf_decode.log" "hf_decode.py"

# ---------------------------------------------------------------------------------------------
# (g) summary
say ""
summarize
say "== device check finished in $(($(now) - START)) s"
# Non-zero when any step failed, timed out or was skipped (the summary above says which).
if cut -f2 "$STEPS" | grep -qv '^ok$'; then exit 1; fi
exit 0
