"""``ucm up``'s pieces that need no engine: notices, ports, core binding, the state it writes."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ucm.deploy import prometheus
from ucm.deploy.local import (
    LocalStack,
    Process,
    StackError,
    _pin_workers,
    cpu_share,
    default_spec,
    kubernetes_only_fields,
    same_process,
    start_time,
    threads_bind,
)
from ucm.deploy.plan import WORKER_INDEX
from ucm.deploy.ports import free_port
from ucm.deploy.roles import STOP_SLACK_S, Group, Port, Probe, Role
from ucm.deploy.spec import UCMDeploymentSpec

pytestmark = pytest.mark.engines  # times things tightly: make test runs it alone (ucm_testing.lanes)


def spec(tmp_path, **overrides) -> UCMDeploymentSpec:
    return UCMDeploymentSpec.model_validate({**default_spec(tmp_path), **overrides})


def test_kubernetes_only_fields_are_named(tmp_path):
    s = spec(
        tmp_path,
        image={"repository": "me/runtime"},
        prefill={"replicas": 1, "resources": {"gpus": 0}, "nodeSelector": {"a": "b"}},
        decode={"autoscaling": {"maxReplicas": 3}, "parallel": {"topologyKey": "topology.kubernetes.io/zone"}},
        proxy={"replicas": 2, "apiKeySecret": {"name": "k"}},
    )
    assert kubernetes_only_fields(s) == [
        "image.repository",
        "prefill.resources",
        "prefill.nodeSelector",
        "decode.autoscaling",
        "decode.parallel.topologyKey",
        "store.pvc (blocks go to the run directory)",
        "proxy.apiKeySecret",
        "proxy.replicas (one proxy runs locally)",
    ]


def test_a_busy_proxy_port_is_refused(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(StackError, match=r"^--port: \d+ is in use"):
            LocalStack(spec(tmp_path), tmp_path / "run", s.getsockname()[1])


def test_roles_get_ports_the_kernel_never_hands_out_itself(tmp_path):
    # Engines bind port 0 for internal sockets while they start; a role's port from that range
    # could be taken before the role binds it (CI saw the proxy fail with "address in use").
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    stack = LocalStack(spec(tmp_path, prefill={"replicas": 2}), tmp_path / "run")
    ports = [p.port for p in stack.processes]
    assert len(set(ports)) == len(ports)
    assert all(20000 <= port < low for port in ports), ports


CHILD = """
import pathlib, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: pathlib.Path(sys.argv[1], "child-got-sigterm").touch())
pathlib.Path(sys.argv[1], "child-ready").touch()
while True:
    time.sleep(1)
"""
LEADER = """
import pathlib, signal, subprocess, sys, time
out = pathlib.Path(sys.argv[1])
child = subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[1]])  # stays in our group
while not (out / "child-ready").exists():
    time.sleep(0.01)
(out / "child-pid.tmp").write_text(str(child.pid))
(out / "child-pid.tmp").rename(out / "child-pid")  # whole, never read half-written

def drain(*_):  # as vLLM drains: in-flight work needs its workers until it is done
    time.sleep(0.3)
    (out / "drained").write_text("child alive" if child.poll() is None else "child gone")
    sys.exit(0)

signal.signal(signal.SIGTERM, drain)
while True:
    time.sleep(1)
"""


def test_stop_signals_the_main_process_and_leaves_no_child(tmp_path):
    """SIGTERM reaches the main process only (as a kubelet sends it), so it drains with its
    children working; whatever it leaves behind is killed with the group."""
    role = Role("engine", "prefill", [sys.executable, "-c", LEADER, str(tmp_path), CHILD], [])
    p = Process(role, tmp_path / "log", {})
    p.start()
    deadline = time.monotonic() + 10
    while not (tmp_path / "child-pid").exists():
        assert time.monotonic() < deadline and p.exited() is None, p.tail()
        time.sleep(0.02)
    child = int((tmp_path / "child-pid").read_text())
    p.stop()
    assert (tmp_path / "drained").read_text() == "child alive"
    assert not (tmp_path / "child-got-sigterm").exists()
    while start_time(child) is not None:  # gone, or a zombie
        assert time.monotonic() < deadline, "the child outlived its role"
        time.sleep(0.02)


# A pod of a group: records its node rank and rendezvous port, then waits.
MEMBER = """
import os, sys, time
args = sys.argv[2:]
rank = args[args.index("--node-rank") + 1]
# Written whole, then renamed: the test polls for the file and must never read it half-written.
open(f"{sys.argv[1]}/.rank-{rank}", "w").write(args[args.index("--master-port") + 1])
os.rename(f"{sys.argv[1]}/.rank-{rank}", f"{sys.argv[1]}/rank-{rank}")
time.sleep(60)
"""


def test_a_group_starts_restarts_and_stops_as_one(tmp_path):
    """An engine over two "pods": the worker gets its rank, both the same rendezvous port; when
    one member dies the group is down, and a restart replaces all of it."""
    command = [sys.executable, "-c", MEMBER, str(tmp_path), "--nnodes", "2"]
    role = Role(
        "decode-0", "decode", [*command, "--node-rank", "0"], [Port("http", free_port())],
        group=Group(2, [*command, "--node-rank", WORKER_INDEX, "--headless"]),
    )  # fmt: skip
    p = Process(role, tmp_path / "decode-0.log", {}, worker_envs=[{}])

    def started() -> tuple[str, str]:
        deadline = time.monotonic() + 10
        while not all((tmp_path / f"rank-{r}").exists() for r in "01"):
            assert time.monotonic() < deadline, p.tail()
            time.sleep(0.02)
        ports = tuple((tmp_path / f"rank-{r}").read_text() for r in "01")
        for r in "01":
            (tmp_path / f"rank-{r}").unlink()
        return ports

    p.start()
    first = started()
    assert first[0] == first[1] and p.exited() is None
    leader, worker = p.popen, p.workers[0]
    assert p.worker_log(1) == tmp_path / "decode-0-1.log"
    worker.kill()
    worker.wait()
    assert p.exited() == -signal.SIGKILL  # the group is down with one pod
    assert f"--- {p.worker_log(1)}:" in p.tail()  # whose log to read
    p.start()  # as supervise restarts it: the leader still running goes too
    assert leader.poll() is not None
    second = started()
    assert second[0] == second[1]
    survivors = [p.popen.pid, p.workers[0].pid]
    p.stop()
    assert all(start_time(pid) is None for pid in survivors)


def test_a_role_that_is_not_serving_yet_gets_no_drain_time(tmp_path):
    """Nothing to drain while it starts (and vLLM may not act on SIGTERM before it serves): the
    slack alone, not the pool's drain timeout, before SIGKILL; a stack stops its groups in turn."""
    role = Role(
        "engine", "decode", [sys.executable, "-c", "import time; time.sleep(60)"], [Port("http", free_port())],
        readiness=Probe("http", "/health"), drain_timeout_s=300,
    )  # fmt: skip
    p = Process(role, tmp_path / "log", {})
    p.start()
    started = time.monotonic()
    deadline = p.begin_stop()
    assert deadline - started <= STOP_SLACK_S + 1
    p.finish_stop(deadline)
    assert time.monotonic() - started < 5  # python exits on SIGTERM at once
    stack = LocalStack(spec(tmp_path, decode={"drainTimeoutS": 120}), tmp_path / "run")
    # The proxy, then the engines together (prefill's default 300 s is the longest), one after the other.
    assert stack.stop_timeout_s() == STOP_SLACK_S + (300 + STOP_SLACK_S)


def test_a_process_that_ended_is_not_the_same_process_even_unreaped():
    """`ucm down` waits for `ucm up` while it is the same process; an exited `ucm up` whose parent
    (a test, a shell script) has not collected it yet must not count (it made `ucm down` wait out
    its whole deadline)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    start = start_time(child.pid)
    while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.01)
    assert not same_process(child.pid, start)
    child.wait()


def test_engines_get_their_own_cores_when_there_are_enough(tmp_path, monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    stack = LocalStack(spec(tmp_path, prefill={"replicas": 2}, decode={"replicas": 2}), tmp_path / "run")
    binds = [p.env.get("VLLM_CPU_OMP_THREADS_BIND") for p in stack.processes]
    assert binds == ["0-1", "2-3", "4-5", "6-7", None]  # the proxy is not bound
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    stack = LocalStack(spec(tmp_path), tmp_path / "run")
    assert [p.env.get("VLLM_CPU_OMP_THREADS_BIND") for p in stack.processes] == ["0-0", "0-0", None]


def test_engines_keep_to_the_cores_the_stack_may_use(tmp_path, monkeypatch):
    """Under taskset or a cpuset (or one core of a parallel test run), engines are bound within it."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {1, 3, 5, 6})
    stack = LocalStack(spec(tmp_path), tmp_path / "run")
    assert [p.env.get("VLLM_CPU_OMP_THREADS_BIND") for p in stack.processes] == ["1,3", "5-6", None]


# A process named as vLLM names its workers (prctl PR_SET_NAME), with a second thread, until killed.
NAMED = """
import ctypes, sys, threading, time
ctypes.CDLL(None).prctl(15, sys.argv[1].encode())
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("ready", flush=True)
time.sleep(60)
"""


def test_a_rolled_engines_worker_is_pinned_to_its_cores_and_nothing_else(tmp_path):
    """After a roll (``LocalStack.roll``), the new engine's vLLM worker threads are bound to its
    role's cores; other processes of its session, and workers of other sessions, keep theirs."""
    allowed = sorted(os.sched_getaffinity(0))
    target = {allowed[-1]}

    def start(name: str) -> subprocess.Popen[str]:
        p = subprocess.Popen(
            [sys.executable, "-c", NAMED, name], stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        return p

    def affinities(pid: int) -> list[set[int]]:
        return [os.sched_getaffinity(int(t.name)) for t in Path(f"/proc/{pid}/task").iterdir()]

    ours, other, api = start("VLLM::Worker"), start("VLLM::Worker"), start("VLLM::EngineCor")
    try:
        assert _pin_workers(ours.pid, target) == 1
        assert _pin_workers(api.pid, target) == 0  # its session holds no worker
        ours_threads = affinities(ours.pid)
        assert len(ours_threads) == 2 and all(a == target for a in ours_threads)
        assert all(a == set(allowed) for a in affinities(other.pid) + affinities(api.pid))
    finally:
        for p in (ours, other, api):
            p.kill()
            p.wait()


def test_pool_env_wins_over_the_defaults(tmp_path):
    s = spec(tmp_path, decode={"env": [{"name": "VLLM_CPU_KVCACHE_SPACE", "value": "4"}]})
    stack = LocalStack(s, tmp_path / "run")
    decode = next(p for p in stack.processes if p.role.component == "decode")
    assert decode.env["VLLM_CPU_KVCACHE_SPACE"] == "4"


def test_files_and_state(tmp_path):
    stack = LocalStack(spec(tmp_path), tmp_path / "run", 0)
    stack.write_files()
    assert sorted(f.name for f in (tmp_path / "run").iterdir()) == [
        "backends.json",
        "credentials",
        "kv",
        "kv-transfer-config.json",
        "logs",
        "proxy.yaml",
    ]
    # The engines' key: a file only this user reads (the proxy's), the engines' environment.
    key_file = tmp_path / "run" / "credentials" / "backend-api-key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "run" / "credentials").stat().st_mode & 0o777 == 0o700
    key = key_file.read_text().strip()
    assert len(key) >= 32
    engines = [p for p in stack.processes if p.role.component in ("prefill", "decode")]
    assert all(p.env["VLLM_API_KEY"] == key for p in engines)
    assert "VLLM_API_KEY" not in stack.proxy.env
    assert yaml.safe_load((tmp_path / "run" / "proxy.yaml").read_text())["backend_api_key_file"] == str(key_file)
    assert stack.base_url.startswith("http://127.0.0.1:") and stack.base_url.endswith("/v1")
    assert stack.state()["roles"] == {}  # nothing started


def test_the_proxy_judges_its_options_before_anything_starts(tmp_path):
    stack = LocalStack(spec(tmp_path, proxy={"config": {"routing": {"decode": "fastest"}}}), tmp_path / "run")
    with pytest.raises(StackError, match=r"^proxy.config: ucm-proxy refuses it: proxy.routing.decode: Input should be"):
        stack.start(lambda *_: None)
    assert all(p.popen is None for p in stack.processes)


def test_ucm_down_signals_only_the_processes_it_started(tmp_path):
    """A PID named in stack.json may belong to anything once its process ended: ucm down checks
    the start time before signalling."""
    from ucm.deploy.local import start_time
    from ucm.deploy.up import STATE_FILE, cmd_down

    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    ours = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        run = tmp_path / "e2e"
        run.mkdir()
        dead = subprocess.Popen(["true"])
        dead.wait()
        state = {
            "pid": dead.pid,
            "start": 1,
            "roles": {
                "decode-0": {"pid": stranger.pid, "start": start_time(stranger.pid) - 1},  # a reused PID
                "prefill-0": {"pid": ours.pid, "start": start_time(ours.pid)},
            },
        }
        (run / STATE_FILE).write_text(json.dumps(state))
        assert cmd_down(argparse.Namespace(run_dir=str(tmp_path), name="e2e")) == 0
        assert ours.wait(10) == -signal.SIGKILL
        assert stranger.poll() is None  # untouched
        assert not (run / STATE_FILE).exists()
    finally:
        stranger.kill()
        ours.kill()


def test_roles_die_with_their_launcher(tmp_path):
    """However ucm up ends (SIGKILL included), what it started does not outlive it."""
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from ucm.deploy.local import Process\n"
        "from ucm.deploy.roles import Role\n"
        "p = Process(Role('x', 'proxy', ['sleep', '60'], []), Path(sys.argv[1]), {})\n"
        "p.start(); print(p.popen.pid, flush=True); time.sleep(60)\n"
    )
    launcher = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path / "x.log")], stdout=subprocess.PIPE, text=True
    )
    child = int(launcher.stdout.readline())
    assert Path(f"/proc/{child}").exists()
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 10
    while start_time(child) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert start_time(child) is None


def test_state_is_written_as_each_role_starts(tmp_path, monkeypatch):
    """A launcher killed while engines start leaves a stack.json that names them."""
    monkeypatch.setattr("ucm.deploy.local.resolve", lambda _: "/bin/false")  # every role "exits at once"
    monkeypatch.setattr("ucm.deploy.local.check_proxy_config", lambda _: None)
    state_path = tmp_path / "stack.json"
    stack = LocalStack(spec(tmp_path), tmp_path / "run", 0, state_path=state_path)
    with pytest.raises(StackError, match="exited with code 1 before it was ready"):
        stack.start(lambda *_: None)
    roles = json.loads(state_path.read_text())["roles"]
    assert set(roles) == {"prefill-0", "decode-0"} and all(r["pid"] and "start" in r for r in roles.values())


def test_a_restart_with_a_changed_spec_rolls_only_the_pools_it_changes(tmp_path):
    stack = LocalStack(spec(tmp_path), tmp_path / "run")
    stack.write_files()
    ports = [p.port for p in stack.processes]
    base = default_spec(tmp_path)
    assert stack.reconfigure(UCMDeploymentSpec.model_validate(base)) == []
    sparse = {**base, "sparse": {"algorithm": "esa"}}  # decode engines only
    assert stack.reconfigure(UCMDeploymentSpec.model_validate(sparse)) == ["decode"]
    assert (tmp_path / "run" / "kv-transfer-config-decode.json").exists()
    model = {**base, "model": {**base["model"], "blockSize": 64}}
    assert stack.reconfigure(UCMDeploymentSpec.model_validate(model)) == ["prefill", "decode"]
    assert [r.ports[0].number for r in stack.plan.roles] == ports  # the same engines, until rolled
    assert "64" in stack.plan.roles[0].command
    with pytest.raises(StackError, match="cannot change the number of engines"):
        stack.reconfigure(UCMDeploymentSpec.model_validate({**base, "decode": {"replicas": 2}}))
    with pytest.raises(StackError, match="cannot change the proxy"):
        stack.reconfigure(UCMDeploymentSpec.model_validate({**base, "proxy": {"config": {"retries": 3}}}))


@pytest.mark.skipif(shutil.which("promtool") is None, reason="Debian's prometheus (make dev installs it)")
@pytest.mark.parametrize("metrics_auth", [False, True])
def test_the_monitor_scrapes_every_engine_and_the_proxy_with_the_shipped_rules(tmp_path, metrics_auth):
    s = spec(tmp_path, decode={"replicas": 2}, proxy={"metricsAuth": metrics_auth})
    stack = LocalStack(s, tmp_path / "run", monitor_port=0)
    stack.write_files()
    token = stack.run_dir / "credentials" / "metrics-token"
    assert token.exists() == metrics_auth
    prometheus.write_config(stack.run_dir, token if metrics_auth else None)
    stack._write_scrape_targets()
    check = subprocess.run(
        ["promtool", "check", "config", str(stack.run_dir / prometheus.CONFIG_FILE)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr  # the rules file it names included
    (job,) = yaml.safe_load((stack.run_dir / prometheus.CONFIG_FILE).read_text())["scrape_configs"]
    assert job.get("authorization") == ({"type": "Bearer", "credentials_file": str(token)} if metrics_auth else None)
    proxy_config = yaml.safe_load((stack.run_dir / "proxy.yaml").read_text())
    assert proxy_config.get("metrics_token_file") == (str(token) if metrics_auth else None)
    targets = json.loads((stack.run_dir / prometheus.TARGETS_FILE).read_text())
    scraped = sorted((t["labels"]["ucm_role"], t["targets"][0]) for t in targets)
    expected = sorted(
        (p.role.component, f"127.0.0.1:{p.port}") for p in stack.processes if p.role.component != "prometheus"
    )
    assert scraped == expected and len(scraped) == 4  # prefill, 2 decode, proxy
    assert {t["labels"]["ucm_deployment"] for t in targets} == {"local"}
    assert stack.monitor is not None and stack.monitor.port not in [p for _, p in scraped]


def test_monitor_without_prometheus_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(StackError, match="apt-get install prometheus"):
        LocalStack(spec(tmp_path), tmp_path / "run", monitor_port=0)


def test_each_rank_of_an_engine_process_gets_its_share_of_the_cores():
    assert threads_bind(range(0, 4), 2) == "0-1|2-3"
    assert threads_bind(range(2, 4), 1) == "2-3"
    assert threads_bind(range(1, 2), 2) == "1-1|1-1"  # fewer cores than ranks: they share
    assert cpu_share(range(0, 4), 1, 2) == range(2, 4)
    assert threads_bind([0, 2, 4, 5], 2) == "0,2|4-5"
