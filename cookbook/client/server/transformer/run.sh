#!/usr/bin/env bash
# Launch the transformers-backend server: `bash run.sh [server_config.yaml|server_config_e2e.yaml]`.
# TWINKLE_MODEL_DIR (a directory or a hub id such as ms://Qwen/Qwen3.5-4B) defaults to the tiny local
# model, which is built first if it is missing.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
config="${1:-server_config.yaml}"
[[ "$config" = /* ]] || config="$here/$config"

export TWINKLE_TRUST_REMOTE_CODE="${TWINKLE_TRUST_REMOTE_CODE:-0}"  # never run a hub model's code unasked
export TWINKLE_MODEL_DIR="${TWINKLE_MODEL_DIR:-./models/tiny-qwen}"
if [[ "$TWINKLE_MODEL_DIR" != *://* && ! -f "$TWINKLE_MODEL_DIR/config.json" ]]; then
  twinkle-server build-tiny-model "$TWINKLE_MODEL_DIR"
fi
export TWINKLE_VL_MODEL_DIR="${TWINKLE_VL_MODEL_DIR:-./models/tiny-vl}"
if grep -q TWINKLE_VL_MODEL_DIR "$config" && [[ "$TWINKLE_VL_MODEL_DIR" != *://* && ! -f "$TWINKLE_VL_MODEL_DIR/config.json" ]]; then
  python -c "import sys; from twinkle.tiny_model import build_tiny_model; build_tiny_model(sys.argv[1], vision=True)" \
    "$TWINKLE_VL_MODEL_DIR"
fi
twinkle-server check-config -c "$config"
exec twinkle-server launch -c "$config"
