#!/usr/bin/env bash
# Launch the Megatron-backend server: `bash run.sh [server_config.yaml|server_config_4b.yaml]`.
# Needs megatron-core and CUDA GPUs; server_config.yaml also needs Redis at $TWINKLE_REDIS_URL.
# TWINKLE_MODEL_DIR (a directory or a hub id such as ms://Qwen/Qwen3.5-4B) defaults to the tiny local
# model, which is built first if it is missing.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
config="${1:-server_config.yaml}"
[[ "$config" = /* ]] || config="$here/$config"

export TWINKLE_TRUST_REMOTE_CODE="${TWINKLE_TRUST_REMOTE_CODE:-0}"
export TWINKLE_MODEL_DIR="${TWINKLE_MODEL_DIR:-./models/tiny-qwen}"
if [[ "$TWINKLE_MODEL_DIR" != *://* && ! -f "$TWINKLE_MODEL_DIR/config.json" ]]; then
  twinkle-server build-tiny-model "$TWINKLE_MODEL_DIR"
fi
twinkle-server check-config -c "$config"
exec twinkle-server launch -c "$config"
