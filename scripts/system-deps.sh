#!/usr/bin/env bash
# System packages: libraries the Python packages need at run time (Mooncake's client links libibverbs
# even when it only speaks TCP) and benchmark tools. Installs only what is missing; needs root.
set -euo pipefail
missing=()
dpkg -s libibverbs1 >/dev/null 2>&1 || missing+=(libibverbs1)
# wrk: the load generator of benchmarks/proxy_overhead.py.
command -v wrk >/dev/null 2>&1 || missing+=(wrk)
# libfuse 3: the stalled store mount of benchmarks/fault_serving.py (ucm_testing.stallfs).
dpkg -s libfuse3-3 >/dev/null 2>&1 || missing+=(fuse3)
# Docker's engine and mmdebstrap: `make images-offline` builds and tests run the images.
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
command -v mmdebstrap >/dev/null 2>&1 || missing+=(mmdebstrap)
# Prometheus and promtool: ucm up --monitor, and the tests that run the shipped rules and dashboard.
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
# node and npm: the tests validate rendered KEDA objects with kubernetes-models' schemas.
command -v npm >/dev/null 2>&1 || missing+=(nodejs npm)
# chromium: the tests open the built docs site in a real browser (Playwright drives Debian's build).
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "system-deps: please install: ${missing[*]} (needs root and apt-get)" >&2
  exit 1
fi
echo "system-deps: installing ${missing[*]}"
apt-get update -qq >/dev/null
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
