#!/usr/bin/env bash
# The CPU test suite, on the newest supported transformers (.venv) and on the oldest, 5.17
# (.venv-tf517). Extra arguments go to pytest. GPU tests: scripts/run_gpu_tests.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
ensure_venv "${KBIT_VENV:-.venv}" "transformers>=5.17"
ensure_venv .venv-tf517 "transformers==5.17.0"
status=0
for venv in "${KBIT_VENV:-.venv}" .venv-tf517; do
  echo ">> pytest with $("$venv/bin/python" -c 'import transformers; print("transformers", transformers.__version__)')"
  "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@" || status=$?
done
exit $status
