#!/usr/bin/env bash
# Real schemas of the non-core objects the operator renders, for the tests: the npm packages of
# kubernetes-models carry KEDA's and the Prometheus Operator's CRD schemas (and validate against
# them). Installed under DIR (the venv's node/ folder); node itself comes from the system
# (scripts/system-deps.sh).
# Usage: install-node-models.sh DIR
set -euo pipefail
dir=${1:?directory}
packages=("@kubernetes-models/keda@2.0.0" "@kubernetes-models/prometheus-operator@6.0.0")
if [ -f "$dir/.installed" ] && [ "$(cat "$dir/.installed")" = "${packages[*]}" ]; then
  exit 0
fi
mkdir -p "$dir"
npm install --silent --no-save --no-audit --no-fund --prefix "$dir" "${packages[@]}"
echo "${packages[*]}" > "$dir/.installed"
