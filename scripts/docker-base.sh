#!/usr/bin/env bash
# A Python base image made from Debian packages, for sites that cannot pull python:*-slim (air-gapped
# clusters, machines without a registry): Debian bookworm (Python 3.11), python3-venv and CA
# certificates, and the PACKAGES an image needs on top (the CPU runtime: libnuma1, g++ and Python's
# headers). The mirror is the one apt already uses here (or MIRROR=URI).
# Usage: docker-base.sh IMAGE [PACKAGE...]    (does nothing when IMAGE exists)
set -euo pipefail
image=${1:?image name, e.g. ucm/base:bookworm}
shift
packages=$(IFS=,; echo "python3,python3-venv,ca-certificates${*:+,$*}")
if docker image inspect "$image" >/dev/null 2>&1; then
  exit 0
fi
mirror=${MIRROR:-$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1)}
mirror=${mirror:-$(awk '$1 == "deb" {print $2; exit}' /etc/apt/sources.list 2>/dev/null)}
: "${mirror:?no Debian mirror found in /etc/apt; set MIRROR}"
tar=$(mktemp --suffix=.tar)
trap 'rm -f "$tar"' EXIT
echo "building $image from $mirror (bookworm, minbase: $packages)"
mmdebstrap --quiet --variant=minbase --include="$packages" bookworm "$tar" "$mirror"
docker import --change 'ENV LANG=C.UTF-8' "$tar" "$image" >/dev/null
