#!/usr/bin/env bash
# Accelerator check (under 8 minutes on a GPU or TPU host): installs the accelerator's jax and this repo,
# finds or fetches SmolLM2-135M-Instruct, runs bench/device_check.py. Its last output line is one JSON object
# (README, "Benchmarks"). With no accelerator it installs nothing and runs the small CPU shape.
#
#   bash bench/device_check.sh                 # extra arguments go to bench/device_check.py
#   MODEL_DIR=/data/smollm2 bash bench/device_check.sh
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python}"
MODEL_DIR="${MODEL_DIR:-$HOME/.cache/smollm2-135m-instruct}"
PIP=("$PY" -m pip install -q --retries 0 --timeout 15)
say() { echo "device_check: $*" >&2; }

accel=none
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  cuda="$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -n 1)"
  [ "${cuda:-12}" -ge 13 ] 2>/dev/null && accel=cuda13 || accel=cuda12
elif compgen -G "/dev/accel*" >/dev/null || [ -e /dev/vfio ]; then
  accel=tpu
fi
say "accelerator: $accel"

if [ "$accel" != none ]; then
  # The repo first (it bounds jax's version), then the plugin of the jax it resolved to.
  "${PIP[@]}" -e . || say "pip install -e . failed (no index?); using what is installed"
  jax_version="$("$PY" -c 'import jax; print(jax.__version__)' 2>/dev/null)"
  "${PIP[@]}" -U "jax[$accel]${jax_version:+==$jax_version}" \
    || say "pip install jax[$accel] failed (no index?); using the installed jax"
  if [ ! -f "$MODEL_DIR/config.json" ]; then
    timeout 150 "$PY" -m launch.fetch_model smollm2 --out="$MODEL_DIR" >&2 \
      || say "could not fetch SmolLM2 into $MODEL_DIR: a random init of its shape instead"
  fi
  set -- --model_dir="$MODEL_DIR" "$@"
else
  set -- --small "$@"
fi

# This checkout's code, whatever an earlier editable install points at.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 330 "$PY" bench/device_check.py "$@"
