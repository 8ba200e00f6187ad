#!/usr/bin/env bash
# A Docker engine to build and run the images: the running one, else dockerd started here (root;
# the daemon keeps running for later builds and test runs, its log in /tmp/ucm-dockerd.log).
set -euo pipefail
docker info >/dev/null 2>&1 && exit 0
if [ "$(id -u)" != 0 ] || ! command -v dockerd >/dev/null; then
  echo "docker-up: no Docker engine answers and dockerd cannot be started here (needs root and docker.io)" >&2
  exit 1
fi
echo "docker-up: starting dockerd"
nohup dockerd >/tmp/ucm-dockerd.log 2>&1 &
for _ in $(seq 60); do
  docker info >/dev/null 2>&1 && exit 0
  sleep 0.5
done
echo "docker-up: dockerd did not answer within 30 s; see /tmp/ucm-dockerd.log" >&2
exit 1
