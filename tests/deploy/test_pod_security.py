"""Every pod rendered for the examples meets the Kubernetes "restricted" Pod Security profile
(https://kubernetes.io/docs/concepts/security/pod-security-standards/), checked rule by rule here:

- baseline: no host namespaces, no privileged containers, no host ports, capabilities added only
  from the baseline list, seccomp not Unconfined, no hostPath volumes;
- restricted: volume types from the allowed list, allowPrivilegeEscalation false, runAsNonRoot,
  no runAsUser 0, seccomp RuntimeDefault or Localhost, capabilities drop ALL (add at most
  NET_BIND_SERVICE).

Volumes the spec itself asks for are the one exception: hostPath (a model directory or a 3FS FUSE
mount on the node) needs a namespace at "privileged" level, an inline NFS volume (store type
``nfs``) one at "baseline". In a "restricted" namespace use store type ``posix`` with a claim bound
to the NFS export, and a model on a claim or a hub."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from ucm.deploy.policy import Policy
from ucm.deploy.render import objects

EXAMPLES = sorted(Path(__file__).parents[2].joinpath("examples").glob("ucmdeployment-*.yaml"))
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def violations(pod: dict[str, Any], asked: set[str]) -> list[str]:
    out = []
    psc = pod.get("securityContext") or {}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            out.append(key)
    for v in pod.get("volumes") or []:
        kind = next(k for k in v if k != "name")
        if kind not in RESTRICTED_VOLUMES | asked:
            out.append(f"volume {v['name']}: {kind}")
    for c in pod["containers"] + pod.get("initContainers", []):
        sc = c.get("securityContext") or {}
        where = f"container {c['name']}"
        if sc.get("privileged"):
            out.append(f"{where}: privileged")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            out.append(f"{where}: hostPort")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{where}: allowPrivilegeEscalation must be false")
        if not (sc.get("runAsNonRoot", psc.get("runAsNonRoot"))):
            out.append(f"{where}: runAsNonRoot must be true")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            out.append(f"{where}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{where}: seccompProfile {seccomp}")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{where}: capabilities must drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"{where}: adds {caps['add']}")
    return out


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_pod_meets_the_restricted_profile(example: Path):
    spec = yaml.safe_load(example.read_text())["spec"]
    asked = {"hostPath"} if "hostPath" in spec["model"]["source"] or spec["store"]["type"] == "ds3fs" else set()
    asked |= {"nfs"} if spec["store"]["type"] == "nfs" else set()
    # What the examples mount.
    bounds = Policy(host_path_prefixes=("/models", "/3fs"), nfs_exports=(("10.0.0.20", "/exports/kv"),))
    rendered = objects(str(example), "ns", None, None, bounds)
    pods = [o["spec"]["template"]["spec"] for o in rendered if o["kind"] == "Deployment"]
    assert pods
    for pod in pods:
        assert violations(pod, asked) == [], pod["containers"][0]["name"]


def test_the_checks_have_teeth():
    pod = {"containers": [{"name": "c"}], "volumes": [{"name": "h", "hostPath": {"path": "/"}}], "hostPID": True}
    found = violations(pod, asked=set())
    assert "hostPID" in found and "volume h: hostPath" in found
    assert "container c: runAsNonRoot must be true" in found and "container c: capabilities must drop ALL" in found
