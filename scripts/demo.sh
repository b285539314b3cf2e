#!/usr/bin/env bash
# The main job: install hf-kbit into .venv and quantize SmolLM2-135M on the CPU
# (python -m hf_kbit.demo; extra arguments go to it, e.g. --bits 3).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
ensure_venv "${KBIT_VENV:-.venv}"
exec "${KBIT_VENV:-.venv}/bin/python" -m hf_kbit.demo "$@"
