#!/usr/bin/env bash
# First README command: install, build, and generate with the bundled stories260K model.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh release
prompt="${1:-Once upon a time, there was a little girl named Lily.}"
exec build/release/bin/specontext generate --model models/stories260K/stories260K.bin \
  --prompt "$prompt" -n 200 --temperature 0.8 --top-p 0.9 --seed 42
