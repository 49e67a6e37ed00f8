#!/usr/bin/env bash
# Builds, HERE (a machine without a GPU, with the Debian packages of scripts/install_deps.sh),
# what bench/gpu/device_check.sh runs on the device machine, which has CUDA 13 and cuBLAS but none
# of our Debian libraries (oneDNN, oneTBB, hwloc, PCRE2, ...) and cannot download anything:
#   build/device            Release, SPECONTEXT_CUDA=ON, NCCL and UCX off, SASS for sm_90 only
#   .device-bundle/         (git-ignored) spx-device-bundle.tar.xz holding bin/ (stripped
#                           specontext, bench_gpu_decode, bench_gpu_copy, test_gpu_*), lib/ (the
#                           shared libraries they need that are not glibc, the CUDA driver or
#                           cuBLAS), lib-cxx/ (libstdc++, libgcc_s: used there only when the
#                           system's are too old) and MANIFEST.txt; plus MANIFEST.txt beside it
# Then prints what travels to the device machine (tracked and untracked files, models/ and data/
# included, plus the bundle) against the 64 MiB limit. Usage, from the repository root:
#   scripts/make_device_bundle.sh [-j N]
# and on the device: the `run` tool with command "bash bench/gpu/device_check.sh",
# carry [".device-bundle"] (gpu/README.md, "Device check").
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
JOBS=2
if [ "${1:-}" = "-j" ] && [ -n "${2:-}" ]; then JOBS=$2; fi
BUILD=build/device
STAGE=build/device-bundle-stage
BUNDLE=.device-bundle
LIMIT_MIB=64

echo "== configure $BUILD (Release, CUDA on, sm_90, no NCCL/UCX)"
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPECONTEXT_CUDA=ON -DSPECONTEXT_NCCL=OFF \
  -DSPECONTEXT_UCX=OFF -DCMAKE_CUDA_ARCHITECTURES=90 -DSPECONTEXT_TESTS=ON >/dev/null

# Every tests/gpu/*_test.cc is one executable test_gpu_<name> (tests/CMakeLists.txt).
TESTS=()
for src in tests/gpu/*_test.cc; do
  name=$(basename "$src" .cc)
  TESTS+=("test_gpu_$name")
done
TARGETS=(specontext bench_gpu_decode bench_gpu_copy "${TESTS[@]}")
echo "== build ${#TARGETS[@]} targets (-j$JOBS): ${TARGETS[*]}"
cmake --build "$BUILD" -j "$JOBS" --target "${TARGETS[@]}"

path_of() {
  case "$1" in
    specontext) echo "$BUILD/bin/specontext" ;;
    bench_gpu_*) echo "$BUILD/bench/gpu/$1" ;;
    test_gpu_*) echo "$BUILD/tests/$1" ;;
  esac
}

echo "== stage $STAGE"
rm -rf "$STAGE"
mkdir -p "$STAGE/bin" "$STAGE/lib" "$STAGE/lib-cxx"
for t in "${TARGETS[@]}"; do
  src=$(path_of "$t")
  [ -x "$src" ] || { echo "missing $src" >&2; exit 1; }
  cp "$src" "$STAGE/bin/$t"
  # --strip-unneeded keeps the allocated sections, the CUDA fatbin (.nv_fatbin) among them.
  strip --strip-unneeded "$STAGE/bin/$t"
done

# Shared libraries the binaries load. Left out: glibc and the dynamic loader (the device has its
# own; what the binaries and lib/ need is printed below), and what the device provides itself:
# the CUDA driver and cuBLAS (found there by device_check.sh). libstdc++ and libgcc_s travel in
# lib-cxx/: this toolchain's need a newer glibc than the binaries do, so device_check.sh adds them
# only when the device's own libstdc++ lacks a symbol version the binaries use. Either way the
# paths are set for our programs only, never for python3.
is_system() {
  case "$1" in
    linux-vdso.so.*|ld-linux*|libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*|libutil.so.*|libresolv.so.*) return 0 ;;
    libcuda.so.*|libcublas.so.*|libcublasLt.so.*|libnvidia-*) return 0 ;;
  esac
  return 1
}
declare -A seen=()
queue=()
for f in "$STAGE"/bin/*; do queue+=("$f"); done
while [ ${#queue[@]} -gt 0 ]; do
  f=${queue[0]}
  queue=("${queue[@]:1}")
  while read -r soname path; do
    [ -n "$soname" ] || continue
    is_system "$soname" && continue
    [ -n "${seen[$soname]:-}" ] && continue
    if [ "$path" = "not" ] || [ ! -e "$path" ]; then
      echo "ldd: $soname of $(basename "$f") not found here" >&2
      exit 1
    fi
    seen[$soname]=1
    case "$soname" in
      libstdc++.so.*|libgcc_s.so.*) dest="$STAGE/lib-cxx" ;;
      *) dest="$STAGE/lib" ;;
    esac
    cp -L "$path" "$dest/$soname"
    chmod u+w "$dest/$soname"
    strip --strip-unneeded "$dest/$soname" 2>/dev/null || true
    queue+=("$dest/$soname")
  done < <(ldd "$f" | awk '$2 == "=>" {print $1, $3}')
done

# The newest symbol versions each group needs (sort -V: highest last).
newest() {
  local prefix=$1
  shift
  for f in "$@"; do objdump -T "$f" 2>/dev/null; done | grep -o "${prefix}_[0-9][0-9.]*" | sort -uV | tail -1
}
glibc_need=$(newest GLIBC "$STAGE"/bin/* "$STAGE"/lib/*)
cxx_need=$(newest GLIBCXX "$STAGE"/bin/* "$STAGE"/lib/*)
glibc_cxx=$(newest GLIBC "$STAGE"/lib-cxx/*)
{
  echo "SpeContext device bundle"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(sed -n 's/^PRETTY_NAME=//p' /etc/os-release | tr -d '"'), $(ldd --version 2>&1 | sed -n 1p)"
  echo "commit: $(git rev-parse HEAD)$(git diff --quiet HEAD -- . ':!.device-bundle' || echo ' (+ uncommitted changes)')"
  echo "nvcc: $(nvcc --version | tail -1)"
  echo "CUDA architectures: 90 (sm_90 SASS + compute_90 PTX)"
  echo "needs on the device: glibc >= ${glibc_need#GLIBC_}, the CUDA driver (libcuda.so.1), libcublas.so.13 and libcublasLt.so.13,"
  echo "  and a libstdc++ with ${cxx_need}: the system's, or lib-cxx/ (which needs glibc >= ${glibc_cxx#GLIBC_})"
  echo "bin:"
  find "$STAGE/bin" -type f -printf '  %f %s\n' | sort
  echo "lib:"
  find "$STAGE/lib" -type f -printf '  %f %s\n' | sort
  echo "lib-cxx:"
  find "$STAGE/lib-cxx" -type f -printf '  %f %s\n' | sort
} >"$STAGE/MANIFEST.txt"

echo "== pack $BUNDLE/spx-device-bundle.tar.xz"
rm -rf "$BUNDLE"
mkdir -p "$BUNDLE"
# One solid xz stream: the binaries share most of their code (the CUDA kernels above all).
tar -C "$STAGE" -cf - MANIFEST.txt bin lib lib-cxx | xz -9e -T1 >"$BUNDLE/spx-device-bundle.tar.xz"
cp "$STAGE/MANIFEST.txt" "$BUNDLE/MANIFEST.txt"
cat "$BUNDLE/MANIFEST.txt"

echo "== sizes"
staged=$(du -sb "$STAGE" | cut -f1)
packed=$(du -cb "$BUNDLE"/* | tail -1 | cut -f1)
# What the device tool sends: tracked files plus untracked files git does not ignore, plus carry.
tree=$( (git ls-files -z --cached --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null | awk '$2 == "total" {s += $1} END {print s + 0}') )
mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
total=$((tree + packed))
echo "  staged (unpacked)          $(mib "$staged") MiB"
echo "  bundle (.device-bundle)    $(mib "$packed") MiB"
echo "  working tree that travels  $(mib "$tree") MiB (models/ $(du -sh models | cut -f1), data/ $(du -sh data | cut -f1))"
echo "  total                      $(mib "$total") MiB of $LIMIT_MIB MiB"
if [ "$total" -ge $((LIMIT_MIB * 1048576)) ]; then
  echo "over the device tool's limit: the run would be refused" >&2
  exit 1
fi
echo "ready: run tool command \"bash bench/gpu/device_check.sh\", carry [\"$BUNDLE\"], timeout_s 540"
