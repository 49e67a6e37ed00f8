#!/usr/bin/env bash
# Second README command: install, build, and run the whole test suite: the release build
# (CUDA code compiled and linked when nvcc exists; GPU tests skip without a device), the same
# tests under ASan+UBSan, and each libFuzzer target for a short run.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
FUZZ_SECONDS="${FUZZ_SECONDS:-20}"

echo "=== release build + tests"
scripts/build.sh release
ctest --preset release -j "$(nproc)" --timeout 900 | tee build/release-ctest.log

echo "=== ASan + UBSan build + tests"
scripts/build.sh asan
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export LSAN_OPTIONS="suppressions=$PWD/tests/sanitizer/lsan.supp"
ctest --preset asan -j "$(nproc)" --timeout 1800 | tee build/asan-ctest.log

echo "=== fuzzers (${FUZZ_SECONDS}s each)"
cmake --preset fuzz >/dev/null
cmake --build build/fuzz --target fuzzers -j "$(nproc)"
fuzzers=(build/fuzz/tests/fuzz_*)
for f in "${fuzzers[@]}"; do
  name="$(basename "$f")"
  corpus="tests/fuzz/corpus/$name"
  work="$(mktemp -d)"
  [ -d "$corpus" ] && cp -r "$corpus"/. "$work"/
  echo "--- $name"
  log="$(mktemp)"
  if ! "$f" -max_total_time="$FUZZ_SECONDS" -print_final_stats=1 "$work" >"$log" 2>&1; then
    tail -n 40 "$log"; echo "fuzzer $name found a failure"; exit 1
  fi
  grep -E "stat::number_of_executed_units" "$log" || true
done
# One closing line for the whole run: ctest cases of both builds plus the fuzzers.
count() { grep -Eo "tests failed out of [0-9]+" "$1" | grep -Eo "[0-9]+$"; }
total=$(( $(count build/release-ctest.log) + $(count build/asan-ctest.log) + ${#fuzzers[@]} ))
echo "tests: ${total} passed, 0 failed"
