#!/usr/bin/env bash
# A Python base image made from Debian packages, for sites that cannot pull python:*-slim (air-gapped
# clusters, machines without a registry): Debian bookworm (Python 3.11), python3-venv and CA
# certificates, and the PACKAGES an image needs on top (the CPU runtime: libnuma1, g++ and Python's
# headers, libibverbs1 and libcurl4 for Mooncake). The mirror is the one apt already uses here (or
# MIRROR=URI).
# Usage: docker-base.sh IMAGE [PACKAGE...]    (does nothing when IMAGE exists with these packages;
# an image made with another list, from an older checkout, is made again)
set -euo pipefail
image=${1:?image name, e.g. ucm/base:bookworm}
shift
packages=$(IFS=,; echo "python3,python3-venv,ca-certificates${*:+,$*}")
if [ "$(docker image inspect -f '{{index .Config.Labels "ucm.packages"}}' "$image" 2>/dev/null)" = "$packages" ]; then
  exit 0
fi
mirror=${MIRROR:-$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1)}
mirror=${mirror:-$(awk '$1 == "deb" {print $2; exit}' /etc/apt/sources.list 2>/dev/null)}
: "${mirror:?no Debian mirror found in /etc/apt; set MIRROR}"
tar=$(mktemp --suffix=.tar)
trap 'rm -f "$tar"' EXIT
echo "building $image from $mirror (bookworm, minbase: $packages)"
mmdebstrap --quiet --variant=minbase --include="$packages" bookworm "$tar" "$mirror"
docker import --change 'ENV LANG=C.UTF-8' --change "LABEL ucm.packages=$packages" "$tar" "$image" >/dev/null
