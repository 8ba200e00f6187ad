"""How the operator scales: N UCMDeployments on kmock, the real operator as its own process.

1. Create N objects at once; time until every one has all its children and a computed status
   (conditions at observedGeneration 1), and count the operator's API calls per object.
2. Stop the operator, start a fresh one on the same kmock state with nothing changed, wait until
   it has gone through every object, and count its writes per object: to children, status and
   Events (``noop_writes_per_object``, must be 0) apart from Kopf's own bookkeeping patches on
   the objects (``kopf_bookkeeping_writes_per_object``).
3. The operator's peak RSS over both runs (``VmHWM`` of its process).

kmock (in this process) stands in for the API server: it runs no controllers and keeps all
objects in memory, so absolute times include its own cost; the counts are exact.

    python benchmarks/operator_scale.py --json OUT.json [--objects 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from ucm.deploy.spec import GROUP, PLURAL, VERSION
from ucm_testing.kmock_operator import WRITE_VERBS, Call, Driver, emulator

NS = "bench"
MODEL_DIR = "/models"
SPEC = {
    "model": {"source": {"hostPath": f"{MODEL_DIR}/llama"}},
    "store": {"type": "posix", "pvc": {"claimName": "kv"}},
}
SETTLE_S = 60  # plus a second per object: past this, the objects never settle
CHILDREN_PER_OBJECT = 12  # ConfigMap, 3 Deployments, 3 Services, 2 PDBs, ServiceAccount, Role, RoleBinding


def start_operator(url: str, log: Path) -> subprocess.Popen[bytes]:
    exe = Path(sys.executable).parent / "ucm-operator"
    return subprocess.Popen(
        # The objects' model is a node path: the operator's policy refuses node paths unless allowed.
        [str(exe), "--server", url, "--liveness", "", "--log-level", "warning", "--allow-host-path", MODEL_DIR],
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,
    )


def stop_operator(proc: subprocess.Popen[bytes]) -> int:
    """Stop it; its peak RSS in bytes (VmHWM)."""
    status = Path(f"/proc/{proc.pid}/status").read_text()
    peak_kib = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")))
    proc.send_signal(signal.SIGINT)
    proc.wait(30)
    return peak_kib * 1024


async def settled(driver: Driver, n: int) -> bool:
    listing = await driver.call("GET", f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}")
    done = 0
    for obj in listing["items"]:
        conds = (obj.get("status") or {}).get("conditions") or []
        done += bool(conds) and all(c.get("observedGeneration") == 1 for c in conds)
    if done < n:
        print(f"  {done}/{n} with a computed status", file=sys.stderr)
        return False
    kids = Counter()
    for kind in ("configmaps", "services", "serviceaccounts"):
        for obj in (await driver.call("GET", f"/api/v1/namespaces/{NS}/{kind}"))["items"]:
            kids[obj["metadata"]["labels"]["app.kubernetes.io/instance"]] += 1
    for path in (
        "apps/v1/namespaces/{ns}/deployments",
        "policy/v1/namespaces/{ns}/poddisruptionbudgets",
        "rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
        "rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
    ):
        for obj in (await driver.call("GET", "/apis/" + path.format(ns=NS)))["items"]:
            kids[obj["metadata"]["labels"]["app.kubernetes.io/instance"]] += 1
    return len(kids) == n and all(v == CHILDREN_PER_OBJECT for v in kids.values())


def classify(calls: list[Call]) -> dict[str, int]:
    writes = [c for c in calls if c.verb in WRITE_VERBS]
    bookkeeping = [c for c in writes if c.resource == PLURAL and c.verb == "patch"]
    return {"calls": len(calls), "writes": len(writes) - len(bookkeeping), "bookkeeping": len(bookkeeping)}


async def run(n: int, log: Path) -> dict[str, Any]:
    async with emulator(history_limit=20) as k:
        url = str(k.url).rstrip("/")
        driver = Driver(url)
        proc = start_operator(url, log)
        try:
            await asyncio.sleep(1.0)  # let it list and watch before the burst
            mark = len(k.calls)
            t0 = time.perf_counter()
            await asyncio.gather(*(driver.apply_ucmd(NS, f"d{i:04d}", SPEC, uid=f"uid-{i}") for i in range(n)))
            deadline = t0 + SETTLE_S + n
            while not await settled(driver, n):
                if time.perf_counter() > deadline:  # a refused spec never settles: say so, don't wait forever
                    tail = log.read_text(errors="replace").splitlines()[-5:]
                    raise SystemExit(
                        f"not settled after {time.perf_counter() - t0:.0f} s; operator log:\n" + "\n".join(tail)
                    )
                await asyncio.sleep(0.5)
            create_s = time.perf_counter() - t0
            await asyncio.sleep(2.0)  # late writes, if any, are counted
            created = classify(k.calls[mark:])
            create_rss = stop_operator(proc)

            mark = len(k.calls)
            t0 = time.perf_counter()
            proc = start_operator(url, log)
            # Done when Kopf's resume pass has touched every object and nothing moved for 3 s (counted
            # from its first call: a loaded machine takes seconds to start it).
            while len(k.calls) == mark and time.perf_counter() - t0 < SETTLE_S:
                await asyncio.sleep(0.1)
            last, quiet_since = -1, time.perf_counter()
            while time.perf_counter() - quiet_since < 3.0:
                now = len(k.calls)
                if now != last:
                    last, quiet_since = now, time.perf_counter()
                await asyncio.sleep(0.25)
            restart_s = time.perf_counter() - t0 - 3.0
            restarted = classify(k.calls[mark:])
            restart_rss = stop_operator(proc)
        finally:
            if proc.poll() is None:
                proc.kill()
            await driver.close()
    return {
        "objects": n,
        "create_until_all_ready_s": round(create_s, 2),
        "create_objects_per_s": round(n / create_s, 1),
        "api_calls_per_object_on_create": round(created["calls"] / n, 2),
        "writes_per_object_on_create": round(created["writes"] / n, 2),
        "kopf_bookkeeping_writes_per_object_on_create": round(created["bookkeeping"] / n, 2),
        "restart_settle_s": round(restart_s, 2),
        "api_calls_per_object_on_restart": round(restarted["calls"] / n, 2),
        "noop_writes_per_object": round(restarted["writes"] / n, 3),
        "kopf_bookkeeping_writes_per_object": round(restarted["bookkeeping"] / n, 3),
        "operator_peak_rss_mib": round(max(create_rss, restart_rss) / 2**20, 1),
        "benchmark_process_peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--objects", type=int, default=200)
    p.add_argument("--quick", action="store_true", help="50 objects")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    n = 50 if args.quick else args.objects
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "operator.log"
        result = asyncio.run(run(n, log))
        # The operator's own errors (Kopf's asyncio shutdown chatter after SIGINT is not counted).
        lines = log.read_text(errors="replace").splitlines()
        errors = [line for line in lines if " ERROR kopf.objects" in line or " ERROR ucm_operator" in line]
    result["operator_error_lines"] = len(errors)
    width = max(map(len, result))
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")
    if errors:
        print("first operator error:", errors[0][:300])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
