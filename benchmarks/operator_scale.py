"""How the operator scales: N UCMDeployments on kmock, the real operator as its own process.

1. Create N objects at once; time until every one has all its children and a computed status
   (conditions at observedGeneration 1), and count the operator's API calls per object.
2. Stop the operator, start a fresh one on the same kmock state with nothing changed, wait until
   it has gone through every object, and count its writes per object: to children, status and
   Events (``noop_writes_per_object``, must be 0) apart from Kopf's own bookkeeping patches on
   the objects (``kopf_bookkeeping_writes_per_object``).
3. Failover: two operators with leader election; kill -9 the leader and change every object's
   spec at once; per object, the seconds from the kill until its change is applied
   (``failover_s``: p50, p99). Bound: the Lease's duration (``failover_bound_s``), what a standby
   that cost nothing would take on average: it counts the duration from its last look that saw a
   renewal, which falls up to one renewal period before or after the kill, so a zero-cost
   failover lands anywhere in the duration plus or minus one look (``failover_bound_range_s``).
4. Drift: scale every object's decode Deployment by hand; per object, the seconds until the
   operator has put it back (``drift_revert_s``: p50, p99).
5. The operator's peak RSS over the runs (``VmHWM`` of its process).

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
from ucm_operator.leader import Timing, lease_path
from ucm_testing.kmock_operator import WRITE_VERBS, Call, Driver, emulator

NS = "bench"
MODEL_DIR = "/models"
SPEC = {
    "model": {"source": {"hostPath": f"{MODEL_DIR}/llama"}},
    "store": {"type": "posix", "pvc": {"claimName": "kv"}},
}
CHANGED = {**SPEC, "decode": {"replicas": 3}}  # the change made while the leader is dead
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
LEASE_S, LOOK_S = Timing().lease_s, Timing().retry_s
SETTLE_S = 60  # plus a second per object: past this, the objects never settle
CHILDREN_PER_OBJECT = 12  # ConfigMap, 3 Deployments, 3 Services, 2 PDBs, ServiceAccount, Role, RoleBinding


def start_operator(url: str, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    exe = Path(sys.executable).parent / "ucm-operator"
    return subprocess.Popen(
        # The objects' model is a node path: the operator's policy refuses node paths unless allowed.
        [str(exe), "--server", url, "--liveness", "", "--log-level", "warning", "--allow-host-path", MODEL_DIR, *extra],
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,
    )


async def stop_operator(proc: subprocess.Popen[bytes]) -> int:
    """Stop it; its peak RSS in bytes (VmHWM). Waited for without blocking the loop kmock serves
    from: a leader gives its Lease up on the way out."""
    status = Path(f"/proc/{proc.pid}/status").read_text()
    peak_kib = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")))
    proc.send_signal(signal.SIGINT)
    deadline = time.perf_counter() + 30
    while proc.poll() is None:
        if time.perf_counter() > deadline:
            raise SystemExit("the operator did not stop within 30 s of SIGINT")
        await asyncio.sleep(0.1)
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


async def until(check: Any, timeout: float) -> Any:
    """``check()``'s first truthy answer, asked every 0.1 s."""
    deadline = time.perf_counter() + timeout
    while not (answer := await check()):
        if time.perf_counter() > deadline:
            raise SystemExit(f"not done after {timeout:.0f} s")
        await asyncio.sleep(0.1)
    return answer


async def lease_holder(driver: Driver) -> str | None:
    try:
        lease = await driver.call("GET", lease_path(NS, "ucm-operator"))
    except AssertionError:  # not created yet
        return None
    return (lease.get("spec") or {}).get("holderIdentity")


async def quiet(k: Any, seconds: float) -> None:
    """Until the operators have made no call for ``seconds`` but on the Lease (renewed, looked at
    every second)."""
    last, since = -1, time.perf_counter()
    while time.perf_counter() - since < seconds:
        count = sum(c.resource != "leases" for c in k.calls)
        if count != last:
            last, since = count, time.perf_counter()
        await asyncio.sleep(0.2)


async def times_until(
    k: Any, driver: Driver, names: list[str], replicas: int, mark: int, since: float, timeout: float
) -> list[float]:
    """Per object, the seconds from ``since`` until the operator's patch of its decode Deployment
    reached the API server (the first after call ``mark``, as kmock received it: listing 600
    Deployments to watch for it would load kmock, which serves the operator too); then every one
    is checked to hold ``replicas``."""
    done: dict[str, float] = {}
    wanted = {f"{DEPLOYMENTS}/{name}-decode": name for name in names}
    seen = mark
    deadline = time.perf_counter() + timeout
    while len(done) < len(names):
        for call, at in zip(k.calls[seen:], k.call_times[seen:], strict=True):
            name = wanted.get(call.path)
            if name is not None and call.verb == "patch" and name not in done:
                done[name] = at - since
        seen = len(k.calls)
        if time.perf_counter() > deadline:
            missing = sorted(set(names) - set(done))
            raise SystemExit(f"no patch of {len(missing)} decode Deployments after {timeout:.0f} s: {missing[:5]}")
        await asyncio.sleep(0.1)
    listing = await driver.call("GET", DEPLOYMENTS)
    decode = [o for o in listing["items"] if o["metadata"]["name"].endswith("-decode")]
    wrong = [o["metadata"]["name"] for o in decode if o["spec"].get("replicas") != replicas]
    if wrong:
        raise SystemExit(f"decode Deployments not at {replicas} replicas after their patch: {wrong[:5]}")
    return list(done.values())


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        q: round(ordered[min(len(ordered) - 1, int(p * len(ordered)))], 2) for q, p in (("p50", 0.5), ("p99", 0.99))
    }


async def run(n: int, log: Path) -> dict[str, Any]:
    async with emulator(history_limit=20) as k:
        url = str(k.url).rstrip("/")
        driver = Driver(url)
        proc = start_operator(url, log)
        pair: dict[str, subprocess.Popen[bytes]] = {}
        try:
            await asyncio.sleep(1.0)  # let it list and watch before the burst
            mark = len(k.calls)
            t0 = time.perf_counter()
            names = [f"d{i:04d}" for i in range(n)]
            await asyncio.gather(*(driver.apply_ucmd(NS, name, SPEC, uid=f"uid-{name}") for name in names))
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
            create_rss = await stop_operator(proc)

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
            restart_rss = await stop_operator(proc)

            pair = {
                name: start_operator(url, log, "--leader-election", "--lease-namespace", NS, "--identity", name)
                for name in ("op-a", "op-b")
            }
            leader = await until(lambda: lease_holder(driver), SETTLE_S + n)
            await quiet(k, 3.0)  # the leader's resume pass done
            pair[leader].kill()
            died, mark = time.perf_counter(), len(k.calls)
            await asyncio.gather(*(driver.update_ucmd(NS, name, CHANGED, generation=2) for name in names))
            replicas = CHANGED["decode"]["replicas"]
            failover = await times_until(k, driver, names, replicas, mark, died, SETTLE_S + n)
            survivor = next(p for name, p in pair.items() if name != leader)

            started, mark = time.perf_counter(), len(k.calls)
            await asyncio.gather(
                *(driver.call("PATCH", f"{DEPLOYMENTS}/{name}-decode", {"spec": {"replicas": 9}}) for name in names)
            )
            drift = await times_until(k, driver, names, replicas, mark, started, SETTLE_S + n)
            failover_rss = await stop_operator(survivor)
        finally:
            for p in [proc, *pair.values()]:
                if p.poll() is None:
                    p.kill()
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
        "failover_s": percentiles(failover),
        "failover_bound_s": LEASE_S,
        "failover_bound_range_s": [LEASE_S - LOOK_S, LEASE_S + LOOK_S],
        "drift_revert_s": percentiles(drift),
        "operator_peak_rss_mib": round(max(create_rss, restart_rss, failover_rss) / 2**20, 1),
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
