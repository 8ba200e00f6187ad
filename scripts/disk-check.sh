#!/usr/bin/env bash
# Refuse to start a build that cannot finish: a build that fills the disk fails late, after minutes,
# with an error from inside Docker that names neither the need nor what holds the space.
# Usage: disk-check.sh DIR GIB WHAT
set -euo pipefail
dir=${1:?directory}
need=${2:?GiB needed}
what=${3:?what needs it}
free=$(df --output=avail -B1G "$dir" | tail -1 | tr -d ' ')
if [ "$free" -lt "$need" ]; then
  echo "disk-check: $what needs ${need} GiB free under $dir; ${free} GiB are." >&2
  echo "  Largest in /tmp (benchmark stores and clean-clone runs left behind are the usual cause):" >&2
  du -xsh /tmp/* 2>/dev/null | sort -rh | head -5 | sed 's/^/    /' >&2 || true
  echo "  Docker's own: docker system df; docker system prune" >&2
  exit 1
fi
