#!/usr/bin/env bash
# Installs the Debian 12 packages the build needs. Idempotent; uses sudo when not root.
set -euo pipefail
PACKAGES=(build-essential cmake ninja-build pkg-config clang-16 libclang-rt-16-dev
          libgtest-dev libgmock-dev libdnnl-dev ocl-icd-opencl-dev libtbb-dev libhwloc-dev libpcre2-dev
          nlohmann-json3-dev libcli11-dev libboost-dev libssl-dev libucx-dev zlib1g-dev libhiredis-dev redis-server
          python3 python3-matplotlib)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "installing: ${missing[*]}"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
