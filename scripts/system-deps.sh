#!/usr/bin/env bash
# System libraries the Python packages need at run time. Mooncake's client links libibverbs
# even when it only speaks TCP. Installs only what is missing; needs root (CI and dev machines are).
set -euo pipefail
missing=()
dpkg -s libibverbs1 >/dev/null 2>&1 || missing+=(libibverbs1)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "system-deps: please install: ${missing[*]} (needs root and apt-get)" >&2
  exit 1
fi
echo "system-deps: installing ${missing[*]}"
apt-get update -qq >/dev/null
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
