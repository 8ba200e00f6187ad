"""The plan (``ucm.deploy.plan``) as local processes: ``ucm up``.

Every role becomes a process on loopback with its own free port and log file; config files go to
the run directory. Before anything starts, the proxy checks its configuration (``ucm-proxy
--check``). Roles start in the plan's order (``ucm.deploy.roles.START_ORDER``: a store's own
servers, then the engines together, then the proxy) and each counts as started only when its
readiness probe answers. A role that dies before it is ready stops the whole stack with its log's
tail; one that dies later is restarted (as Kubernetes would restart its pod), at most
``MAX_RESTARTS`` times. An engine spread over several pods (``parallel.nodes``) is a leader and
its workers here, started, restarted and stopped together (:class:`Process`).

``ucm restart`` rolls engine pools as a Deployment with ``maxSurge: 1, maxUnavailable: 0`` does
(:meth:`LocalStack.roll`): the proxy reads its backends from a file (``plan.BACKENDS_FILE``) that
``ucm up`` rewrites, so a new engine joins before the old one leaves and drains.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic.alias_generators import to_camel

from ucm.cpu import native_bfloat16
from ucm.deploy import prometheus
from ucm.deploy.plan import (
    BACKENDS_FILE,
    PROXY_CONFIG_FILE,
    WORKER_INDEX,
    backends_json,
    build_plan,
    kv_events_config,
)
from ucm.deploy.ports import free_port, port_is_free
from ucm.deploy.roles import (
    CREDENTIALS,
    ENGINES,
    METRICS_TOKEN,
    STOP_SLACK_S,
    Plan,
    Port,
    Probe,
    Role,
    Site,
    credentials_secret,
)
from ucm.deploy.spec import UCMDeploymentSpec
from ucm.kv_events import ipc_event_endpoints

MAX_RESTARTS = 3
PROXY_SEES_S = 10.0  # how long a roll waits for the proxy to take up a new backends file


class StackError(RuntimeError):
    """The stack cannot start or keep running; the message says why and where to look."""


def default_spec(model_path: str | Path) -> dict[str, Any]:
    """The embedded stack: a model on this machine, a POSIX store in the run directory, one
    prefill and one decode engine (vLLM's CPU settings), and the proxy."""
    return {
        "model": {
            "source": {"hostPath": str(model_path)},
            "servedName": "tiny",
            "dtype": "float32",
            "blockSize": 32,
            "maxModelLen": 4096,
            "extraArgs": ["--enforce-eager", "--max-num-seqs", "16"],
        },
        "prefill": {"replicas": 1},
        "decode": {"replicas": 1},
        "store": {"type": "posix", "pvc": {"claimName": "local"}},
        # The demo's prompts are short: every request goes through prefill, so the demo shows the
        # PD path (a deployment's default disaggregates only prompts decode would compute slowly).
        "proxy": {"config": {"fallback_to_decode": True, "disaggregation": {"min_prefill_tokens": 0}}},
    }


def kubernetes_only_fields(spec: UCMDeploymentSpec) -> list[str]:
    """Fields the user set that only mean something in a cluster (ignored locally)."""
    out = [f"image.{to_camel(f)}" for f in sorted(spec.image.model_fields_set)]
    for pool_name in ENGINES:
        pool = getattr(spec, pool_name)
        for f in ("resources", "node_selector", "tolerations", "affinity", "autoscaling", "rollout"):
            if f in pool.model_fields_set:
                out.append(f"{pool_name}.{to_camel(f)}")
        if pool.parallel.topology_key is not None:
            out.append(f"{pool_name}.parallel.topologyKey")
        out += [
            f"{pool_name}.env[{i}].valueFrom (set it in your shell)" for i, e in enumerate(pool.env) if e.value_from
        ]
    out += spec.store.kind.kubernetes_only(spec.store.options)
    for f in ("service", "api_key_secret"):
        if f in spec.proxy.model_fields_set:
            out.append(f"proxy.{to_camel(f)}")
    if spec.monitoring.scrapers:
        out.append("monitoring.scrapers (nothing restricts loopback)")
    if spec.proxy.replicas > 1:
        out.append("proxy.replicas (one proxy runs locally)")
    return out


def resolve(executable: str) -> str:
    """Console scripts of this installation first (``ucm``, ``ucm-proxy``, ``mooncake_master``)."""
    here = Path(sys.executable).parent / executable
    if here.exists():
        return str(here)
    found = shutil.which(executable)
    if found is None:
        raise StackError(f"{executable}: not found in {here.parent} or on PATH")
    return found


@dataclass
class Process:
    """One role's process, or for an engine spread over several pods (``role.group``) its leader
    and its workers, which start, restart and stop together as a LeaderWorkerSet's pods do."""

    role: Role
    log: Path
    env: dict[str, str]
    popen: subprocess.Popen[bytes] | None = None
    ready: bool = False
    restarts: int = 0
    started_at: float = field(default_factory=time.monotonic)
    worker_envs: list[dict[str, str]] = field(default_factory=list)  # a group's workers, rank 1 on
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def port(self) -> int:
        return self.role.ports[0].number

    def worker_log(self, rank: int) -> Path:
        return self.log.with_name(f"{self.log.stem}-{rank}{self.log.suffix}")

    def start(self) -> None:
        """Start the role; a group starts whole (what is left of it after a member died goes first),
        workers before the leader, with a rendezvous port of its own: groups on one machine share
        an address, where pods would each have one."""
        self._kill_leftovers()
        self.popen = None
        command = list(self.role.command)
        if self.role.group is not None:
            rendezvous = ["--master-port", str(free_port())]
            command += rendezvous
            worker = self.role.group.worker_command
            for rank in range(1, self.role.group.size):  # each kept as it starts: a failure stops it
                self.workers.append(
                    self._spawn(
                        [str(rank) if a == WORKER_INDEX else a for a in worker] + rendezvous,
                        self.worker_log(rank),
                        self.worker_envs[rank - 1],
                    )
                )
        self.popen = self._spawn(command, self.log, self.env)
        self.ready = False
        self.started_at = time.monotonic()

    @staticmethod
    def _spawn(command: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(log_path, "ab") as log:
            return subprocess.Popen(
                [resolve(command[0]), *command[1:]],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,  # it only calls prctl between fork and exec
            )

    def _kill_leftovers(self) -> None:
        """What still runs of a group one of whose members ended, or of a leader's session (its
        children) once it ended."""
        if self.popen is not None:
            _kill_group(self.popen)
        self._kill_workers()

    def _kill_workers(self) -> None:
        for worker in self.workers:
            _kill_group(worker)
        self.workers = []

    def exited(self) -> int | None:
        """The exit code of the leader or of a worker that ended (a group is down when one pod is)."""
        for member in [self.popen, *self.workers]:
            code = None if member is None else member.poll()
            if code is not None:
                return code
        return None

    def probe(self) -> bool:
        p: Probe | None = self.role.readiness
        if p is None:
            return self.exited() is None
        port = next(x.number for x in self.role.ports if x.name == p.port)
        if p.path is None:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    return True
            except OSError:
                return False
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{p.path}", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def tail(self, chars: int = 3000) -> str:
        """The end of the log, then of each worker's that has ended (under its path)."""
        ended = [self.worker_log(rank) for rank, w in enumerate(self.workers, 1) if w.poll() is not None]
        parts = [_log_tail(self.log, chars)]
        parts += [f"\n--- {log}:\n{_log_tail(log, chars)}" for log in ended]
        return "".join(parts)

    def stop(self) -> None:
        self.finish_stop(self.begin_stop())

    def begin_stop(self) -> float:
        """As a kubelet stops a container: SIGTERM to the main process only, which drains and then
        stops its own children (a SIGTERM to the whole group killed vLLM's workers under the drain
        and failed the requests in flight with 500s). Returns the deadline for :meth:`finish_stop`:
        the role's drain timeout (and some slack) when it is serving, the slack alone when it is
        not (still starting: nothing to drain, and vLLM may not act on SIGTERM before it serves)."""
        if self.popen is None or self.popen.poll() is not None:
            return time.monotonic()
        grace = self.stop_grace_s if self.probe() else STOP_SLACK_S
        self.popen.send_signal(signal.SIGTERM)
        return time.monotonic() + grace

    def finish_stop(self, deadline: float) -> None:
        """Waits for the main process until ``deadline``, then SIGKILLs what is left of the group:
        no child outlives the role."""
        if self.popen is not None:
            try:
                self.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _kill_group(self.popen)
        self._kill_workers()  # headless: they serve nothing once the leader is gone (or never started)

    @property
    def stop_grace_s(self) -> float:
        return self.role.drain_timeout_s + STOP_SLACK_S


class LocalStack:
    def __init__(
        self,
        spec: UCMDeploymentSpec,
        run_dir: Path,
        proxy_port: int = 0,
        name: str = "local",
        state_path: Path | None = None,
        monitor_port: int | None = None,
    ) -> None:
        self.spec, self.name = spec, name
        self.state_path = state_path  # written whenever a process starts: `ucm down` finds them all
        self.run_dir = run_dir
        self.logs = run_dir / "logs"
        if proxy_port and not port_is_free(proxy_port):
            raise StackError(f"--port: {proxy_port} is in use; choose another (0 picks any free port)")
        self._ports: dict[str, int] = {"proxy": proxy_port} if proxy_port else {}
        self.plan: Plan = build_plan(name, spec, self.site())
        _check_paths(spec)
        self._prepared: set[tuple[str, ...]] = set()  # the steps run (downloads), each once per stack
        # Made once per run directory, like the operator's Secret per deployment (the MAC key must
        # outlive a restart, or the blocks already stored fail their check): files, and env for engines.
        self.credentials = {key: self._credential(key) for key in self.plan.credentials}
        engines = self._engine_names()
        self.processes = [self._process(r, engines) for r in self.plan.roles]
        # --monitor: a Prometheus beside the deployment's roles, supervised and recorded like them.
        self.monitor: Process | None = None
        if monitor_port is not None:
            if shutil.which("prometheus") is None:
                raise StackError("--monitor: prometheus is not installed (Debian: apt-get install prometheus)")
            if monitor_port and not port_is_free(monitor_port):
                raise StackError(f"--monitor-port: {monitor_port} is in use; choose another (0 picks any free port)")
            port = monitor_port or free_port(taken=self._ports.values())
            self.monitor = Process(prometheus.role(run_dir, port), self.logs / "prometheus.log", dict(os.environ))
            self.processes.append(self.monitor)
        self.rollout: dict[str, Any] | None = None  # the last `ucm restart`'s outcome

    def _process(self, role: Role, engines: list[str]) -> Process:
        envs = self._member_envs(role, engines)
        return Process(role, self.logs / f"{role.name}.log", envs[0], worker_envs=envs[1:])

    def _member_envs(self, role: Role, engines: list[str]) -> list[dict[str, str]]:
        """The environment of each process of the role: the leader's first, then its workers'."""
        size = group_size(role)
        return [self._env(role, engines, member, size) for member in range(size)]

    def _engine_names(self) -> list[str]:
        return [r.name for r in self.plan.roles if r.component in ENGINES]

    def reconfigure(self, spec: UCMDeploymentSpec) -> list[str]:
        """Take a changed spec for the engines (model, store, block size, ...): its files are written
        and the next :meth:`roll` starts engines from it. Returns the pools whose engines change.
        What cannot change in a roll (the pools' sizes, the proxy) is refused: ``ucm down``/``up``."""
        plan = build_plan(self.name, spec, self.site())
        _check_paths(spec)
        if [(r.name, r.component) for r in plan.roles] != [(r.name, r.component) for r in self.plan.roles]:
            raise StackError("a restart cannot change the number of engines; use ucm down, then ucm up")
        if plan.files[PROXY_CONFIG_FILE] != self.plan.files[PROXY_CONFIG_FILE]:
            raise StackError("a restart cannot change the proxy; use ucm down, then ucm up")
        for filename, text in plan.files.items():
            if filename != BACKENDS_FILE:  # the live one: the roll rewrites it
                (self.run_dir / filename).write_text(text)
        changed = [
            r.component
            for r, was in zip(plan.roles, self.plan.roles, strict=True)
            if r.component in ENGINES and (r != was or any(plan.files[f] != self.plan.files[f] for f in r.files))
        ]
        self.spec, self.plan = spec, plan
        return list(dict.fromkeys(changed))

    def site(self) -> Site:
        return Site(
            "local",
            config_dir=str(self.run_dir),
            kv_dir=str(self.run_dir / "kv"),
            adapters_dir=str(self.run_dir / "adapters"),
            ports=self._port,
            native_bfloat16=native_bfloat16(),
        )

    def _port(self, role: str) -> int:
        """A role's port, stable per name (a rolled engine's is its new one)."""
        if role not in self._ports:
            self._ports[role] = free_port(taken=self._ports.values())
        return self._ports[role]

    @property
    def proxy(self) -> Process:
        return next(p for p in self.processes if p.role.component == "proxy")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy.port}/v1"

    def _env(self, role: Role, engines: list[str], member: int = 0, members: int = 1) -> dict[str, str]:
        """A role's environment; for an engine, its cores (a group's share of them for ``member``)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if role.component in ENGINES:
            cpus = cpu_share(engine_cpus(role.name, engines), member, members)
            env.update(
                {
                    "VLLM_CPU_KVCACHE_SPACE": "1",
                    "VLLM_CPU_OMP_THREADS_BIND": threads_bind(cpus, local_ranks(role)),
                    "GLOG_minloglevel": "2",
                }
            )
        env.update(role.env)
        own = credentials_secret(self.name)
        # Other Secrets exist only in a cluster: locally such a variable comes from your shell.
        env.update({var: self.credentials[ref.key] for var, ref in role.secret_env.items() if ref.secret == own})
        return env

    def _credential(self, key: str) -> str:
        try:
            return (self.run_dir / CREDENTIALS / key).read_text().strip()
        except FileNotFoundError:
            return secrets.token_urlsafe(32)

    def write_files(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "kv").mkdir(parents=True, exist_ok=True)
        for filename, text in self.plan.files.items():
            (self.run_dir / filename).write_text(text)
        credentials = self.run_dir / CREDENTIALS
        credentials.mkdir(mode=0o700, exist_ok=True)
        for key, value in self.credentials.items():
            path = credentials / key
            path.unlink(missing_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never readable by others
            with os.fdopen(fd, "w") as f:
                f.write(value + "\n")

    def state(self) -> dict[str, Any]:
        """What `ucm down` needs: each process with its start time, so a reused PID is not ours."""
        return {
            "pid": os.getpid(),
            "start": start_time(os.getpid()),
            "base_url": self.base_url,
            "stop_timeout_s": self.stop_timeout_s(),  # how long `ucm down` lets it drain
            "rollout": self.rollout,
            "roles": {
                p.role.name: {
                    "pid": p.popen.pid,
                    "start": start_time(p.popen.pid),
                    "url": f"http://127.0.0.1:{p.port}",
                    "restarts": p.restarts,
                    "workers": [{"pid": w.pid, "start": start_time(w.pid)} for w in p.workers],
                }
                for p in self.processes
                if p.popen is not None
            },
        }

    def save_state(self) -> None:
        if self.state_path is not None:
            write_state(self.state_path, self.state())

    def start(self, progress: Callable[[str, list[Process]], None], timeout: float = 600.0) -> None:
        """Start every role in order; returns when all are ready. On failure stops what started."""
        self.write_files()
        check_proxy_config(self.run_dir / PROXY_CONFIG_FILE)
        deadline = time.monotonic() + timeout
        try:
            for roles in self.plan.start_groups():
                group = [p for p in self.processes if p.role in roles]
                self._prepare(group, progress)
                for p in group:
                    p.start()
                    self.save_state()
                    progress(f"starting {p.role.name} on port {p.port} (log: {p.log})", [])
                self._wait_ready(group, deadline, progress)
            if self.monitor is not None:
                token = self.run_dir / CREDENTIALS / METRICS_TOKEN if METRICS_TOKEN in self.credentials else None
                prometheus.write_config(self.run_dir, token)
                self._write_scrape_targets()
                self.monitor.start()
                self.save_state()
                progress(f"starting prometheus on port {self.monitor.port} (log: {self.monitor.log})", [])
                self._wait_ready([self.monitor], deadline, progress)
        except BaseException:
            self.stop()
            raise

    def _prepare(self, processes: list[Process], progress: Callable[[str, list[Process]], None]) -> None:
        """Run the steps of these roles (downloads) that have not run in this stack yet, each once:
        the engines of both pools share what one wrote, where pods each have their own."""
        for p in processes:
            for step in p.role.steps:
                if tuple(step.command) in self._prepared:
                    continue
                log = self.logs / f"{step.name}.log"
                shown = " ".join(step.command)
                progress(f"{p.role.name}: {step.name}: {shown} (log: {log})", [])
                with open(log, "ab") as out:
                    done = subprocess.run(
                        [resolve(step.command[0]), *step.command[1:]],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=p.env,
                        check=False,
                    )
                if done.returncode != 0:
                    raise StackError(
                        f"{p.role.name}: {step.name} ({shown}) exited with code {done.returncode}; "
                        f"its log ({log}) ends:\n{_log_tail(log, 3000)}"
                    )
                self._prepared.add(tuple(step.command))

    def _write_scrape_targets(self) -> None:
        if self.monitor is not None:
            scraped = [p for p in self.processes if p.role.component in (*ENGINES, "proxy")]
            endpoints = [(p.role.component, p.port) for p in scraped]
            write_state(self.run_dir / prometheus.TARGETS_FILE, prometheus.targets(self.name, endpoints))

    def _wait_ready(
        self, group: list[Process], deadline: float, progress: Callable[[str, list[Process]], None]
    ) -> None:
        waiting = list(group)
        while waiting:
            for p in list(waiting):
                code = p.exited()
                if code is not None:
                    raise StackError(
                        f"{p.role.name} exited with code {code} before it was ready; "
                        f"its log ({p.log}) ends:\n{p.tail()}"
                    )
                if p.probe():
                    p.ready = True
                    waiting.remove(p)
                    progress(f"{p.role.name} ready after {time.monotonic() - p.started_at:.0f} s", [])
            if waiting and time.monotonic() > deadline:
                names = ", ".join(p.role.name for p in waiting)
                raise StackError(f"{names} not ready in time; see {self.logs}")
            if waiting:
                progress("", waiting)
                time.sleep(0.5)

    def supervise(self, report: Callable[[str], None]) -> None:
        """Restart roles that died after being ready; raise when one keeps dying."""
        for p in self.processes:
            code = p.exited()
            if code is None:
                continue
            if p.restarts >= MAX_RESTARTS:
                raise StackError(
                    f"{p.role.name} exited (code {code}) {p.restarts + 1} times; its log ({p.log}) ends:\n{p.tail()}"
                )
            p.restarts += 1
            report(f"{p.role.name} exited with code {code}; restarting ({p.restarts}/{MAX_RESTARTS})")
            p.start()
            self.save_state()

    def roll(
        self, components: Sequence[str], progress: Callable[[str, list[Process]], None], timeout: float = 600.0
    ) -> None:
        """Replace every engine of these pools, one at a time: a new one starts on a new port and
        becomes ready, the proxy takes it up, the old one leaves the proxy's pools and then drains
        (its requests in flight finish). The pool never has fewer ready engines than before. A new
        engine that does not become ready is stopped and the old one serves on (StackError)."""
        for old in [p for p in self.processes if p.role.component in components]:
            port = free_port(taken=[p.port for p in self.processes])
            role = next(r for r in self.plan.roles if r.name == old.role.name)  # after reconfigure: the new one
            # Pinned only once the old one is gone: pinned to the cores of the engine it replaces
            # from the start, a new engine took minutes to start under load on a 2-core machine.
            # Its OpenMP thread count is its role's from the start (threads cannot be added later).
            engines = self._engine_names()
            size = group_size(role)
            pinned = self._member_envs(role, engines)
            cores = [cpu_share(engine_cpus(role.name, engines), member, size) for member in range(size)]
            per_rank = [len(cpu_share(cpus, 0, local_ranks(role))) for cpus in cores]
            unpinned = [
                {**env, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads)}
                for env, threads in zip(pinned, per_rank, strict=True)
            ]
            new = Process(on_port(role, port, self.plan.name), old.log, unpinned[0], worker_envs=unpinned[1:])
            progress(f"rolling {old.role.name}: a new one on port {port}", [])
            self._prepare([new], progress)
            try:
                new.start()
                self._wait_ready([new], time.monotonic() + timeout, progress)
                self._serve_from([p for p in self.processes if p.role.component in ENGINES] + [new])
                self._serve_from([p for p in self.processes if p.role.component in ENGINES and p is not old] + [new])
            except BaseException:
                new.stop()
                self._serve_from([p for p in self.processes if p.role.component in ENGINES])
                raise
            self.processes[self.processes.index(old)] = new
            self._ports[role.name] = port
            self.plan.roles[self.plan.roles.index(role)] = new.role
            self.save_state()
            self._write_scrape_targets()
            progress(f"{old.role.name}: port {old.port} draining", [])
            old.stop()
            assert new.popen is not None
            for session, cpus in zip([new.popen.pid, *(w.pid for w in new.workers)], cores, strict=True):
                if not _pin_workers(session, set(cpus)):
                    progress(f"{role.name}: no vLLM worker process found to pin to cores {cpu_list(cpus)}", [])
            new.env, new.worker_envs = pinned[0], pinned[1:]  # were it to die, it restarts pinned, as at `ucm up`

    def _serve_from(self, engines: list[Process]) -> None:
        """Point the proxy at these engines (its backends file, replaced whole) and wait until its
        pools say so (its /metrics names each backend it has)."""
        urls: dict[str, list[str]] = {}
        for p in engines:
            urls.setdefault(p.role.component, []).append(f"http://127.0.0.1:{p.port}")
        path = self.run_dir / BACKENDS_FILE
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(backends_json(urls))
        tmp.replace(path)
        want = {u for pool in urls.values() for u in pool}
        deadline = time.monotonic() + PROXY_SEES_S
        while time.monotonic() < deadline:
            if self._proxy_backends() == want:
                return
            time.sleep(0.1)
        raise StackError(f"the proxy did not take up {path} within {PROXY_SEES_S:g} s; see {self.proxy.log}")

    def _scrape_auth(self) -> dict[str, str]:
        token = self.credentials.get(METRICS_TOKEN)
        return {"Authorization": f"Bearer {token}"} if token else {}

    def _proxy_backends(self) -> set[str] | None:
        try:
            request = urllib.request.Request(f"http://127.0.0.1:{self.proxy.port}/metrics", headers=self._scrape_auth())
            with urllib.request.urlopen(request, timeout=2) as r:
                text = r.read().decode()
        except (urllib.error.URLError, OSError):
            return None
        prefix = 'ucm_proxy_backend_healthy{backend="'
        return {line[len(prefix) :].split('"', 1)[0] for line in text.splitlines() if line.startswith(prefix)}

    def stop(self) -> None:
        """In the reverse of the start order: proxy first (no new requests), then engines, then the
        store's own servers; the roles of a group drain together. A monitor goes first."""
        if self.monitor is not None:
            self.monitor.stop()
        for roles in reversed(self.plan.start_groups()):
            group = [p for p in self.processes if p.role in roles]
            deadlines = [p.begin_stop() for p in group]
            for p, deadline in zip(group, deadlines, strict=True):
                p.finish_stop(deadline)

    def stop_timeout_s(self) -> float:
        """The longest :meth:`stop` can take: each group's longest grace, one group after another."""
        return sum(
            max((p.stop_grace_s for p in self.processes if p.role in roles), default=0.0)
            for roles in self.plan.start_groups()
        )


def _check_paths(spec: UCMDeploymentSpec) -> None:
    """The node paths a spec names, on this machine: engines would fail on them after minutes."""
    source = spec.model.source
    if source.host_path is not None and not Path(source.host_path).is_dir():
        raise StackError(f"model.source.hostPath: {source.host_path} is not a directory on this machine")
    for i, adapter in enumerate(spec.lora.adapters if spec.lora is not None else ()):
        path = adapter.source.host_path
        if path is not None and not (Path(path) / "adapter_config.json").is_file():
            raise StackError(
                f"lora.adapters[{i}].source.hostPath: {path} is not a LoRA adapter's directory on this machine "
                "(no adapter_config.json)"
            )


def on_port(role: Role, port: int, deployment: str) -> Role:
    """The role listening on another port (its command's ``--port`` and its port; the KV event sockets
    of a prefill engine, which are named by its port)."""
    command = list(role.command)
    command[command.index("--port") + 1] = str(port)
    if "--kv-events-config" in command:
        command[command.index("--kv-events-config") + 1] = kv_events_config(*ipc_event_endpoints(deployment, port))
    return replace(role, command=command, ports=[Port(role.ports[0].name, port)])


def check_proxy_config(path: Path) -> None:
    """The proxy validates its own configuration (the deployment passes ``proxy.config`` through)."""
    done = subprocess.run(
        [resolve("ucm-proxy"), "--check", "--config", str(path)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        message = (done.stderr or done.stdout).strip().removeprefix("ucm-proxy: error: ")
        raise StackError(f"proxy.config: ucm-proxy refuses it: {message}")


def write_state(path: Path, state: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(path)  # a reader never sees half a file


def _proc_stat(pid: int | str) -> tuple[str, list[str]] | None:
    """A process's command name and the /proc/<pid>/stat fields after it (from field 3, its
    state); None if it is gone. The name may hold spaces and parentheses: it ends at the last ')'."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name, _, rest = stat.partition("(")[2].rpartition(")")
    return name, rest.split()


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, /proc/<pid>/stat field 22); None if it is gone.
    A PID is reused once its process ends; the pair (pid, start time) is not."""
    stat = _proc_stat(pid)
    if stat is None or stat[1][0] == "Z":  # gone, or it ended and only its parent has not collected it yet
        return None
    return int(stat[1][19])


def same_process(pid: int, start: int | None) -> bool:
    return start is not None and start_time(pid) == start


_PR_SET_PDEATHSIG = 1


def usable_cpus() -> list[int]:
    """The cores this process may run on: its affinity (``taskset``, a container's cpuset, a test
    worker's share of the machine), which can be fewer than the machine has."""
    return sorted(os.sched_getaffinity(0))


def engine_cpus(name: str, engines: list[str]) -> Sequence[int]:
    """The cores an engine's OpenMP threads are bound to. vLLM's CPU backend binds them; explicit
    binding avoids its default holding a core back. Engines get disjoint cores when there are
    enough: an idle vLLM worker busy-polls for a second after each request, which would steal a
    shared core from the engine that has work (measured: benchmarks/e2e_serving.py)."""
    cores = usable_cpus()
    per = max(1, len(cores) // len(engines))
    first = (engines.index(name) * per) % len(cores)
    return cores[first : first + per]


def _log_tail(path: Path, chars: int) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _kill_group(popen: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process's session (it was started as its leader), then reap it."""
    with contextlib.suppress(ProcessLookupError):  # the group may have emptied with its leader
        os.killpg(popen.pid, signal.SIGKILL)
    popen.wait()


def cpu_share(cpus: Sequence[int], index: int, count: int) -> Sequence[int]:
    """Share ``index`` of ``count`` of these cores (a group's pods, a pod's ranks each have their
    own), or all of them when there are fewer cores than shares."""
    if len(cpus) < count:
        return cpus
    per = len(cpus) // count
    return cpus[index * per : (index + 1) * per]


def group_size(role: Role) -> int:
    """The processes the role runs: an engine's pods, or one."""
    return role.group.size if role.group is not None else 1


def local_ranks(role: Role) -> int:
    """The engine's ranks one of its processes runs."""
    return 1 if role.pool is None else role.pool.parallel.ranks_per_node


def threads_bind(cpus: Sequence[int], ranks: int) -> str:
    """vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` for a process running ``ranks`` ranks on these cores:
    one core list per rank, ``|`` between them."""
    return "|".join(cpu_list(cpu_share(cpus, r, ranks)) for r in range(ranks))


def cpu_list(cpus: Sequence[int]) -> str:
    """Cores as Linux and vLLM write them: ``2-3`` for a run, ``0,2`` otherwise."""
    if list(cpus) == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


def vllm_workers(session: int) -> list[int]:
    """The vLLM worker processes in this session (an engine started with ``start_new_session``)."""
    found = []
    for entry in Path("/proc").iterdir():
        stat = _proc_stat(entry.name) if entry.name.isdigit() else None  # None too if it ended meanwhile
        if stat is not None and stat[0].startswith("VLLM::Worker") and int(stat[1][3]) == session:
            found.append(int(entry.name))
    return found


def _pin_workers(session: int, cpus: set[int]) -> int:
    """Bind every thread of the session's vLLM workers to these cores, as VLLM_CPU_OMP_THREADS_BIND
    does at start; the number of processes pinned."""
    pinned = 0
    for pid in vllm_workers(session):
        try:
            threads = [int(task.name) for task in Path(f"/proc/{pid}/task").iterdir()]
        except OSError:
            continue  # it ended meanwhile
        for thread in threads:
            with contextlib.suppress(OSError):  # it ended meanwhile
                os.sched_setaffinity(thread, cpus)
        pinned += 1
    return pinned


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM it when `ucm up` dies, however it dies (Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
