"""``ucm up`` / ``ucm down`` / ``ucm restart``: run a ``UCMDeployment`` on this machine (see
``ucm.deploy.local``).

``ucm restart`` asks the running ``ucm up`` to roll pools: it writes ``restart.json`` (the pools
and a request id) next to ``stack.json`` and sends SIGUSR1; ``ucm up`` rolls them between its
supervision rounds and records the outcome under ``rollout`` in ``stack.json``, which ``ucm
restart`` waits for."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Any

from ucm.config import ConfigError
from ucm.deploy.local import (
    LocalStack,
    Process,
    StackError,
    default_spec,
    kubernetes_only_fields,
    same_process,
    write_state,
)
from ucm.deploy.plan import engine_dtype
from ucm.deploy.resource import load_resource
from ucm.deploy.roles import PlanError
from ucm.deploy.spec import UCMDeploymentSpec, read_spec

STATE_FILE = "stack.json"
RESTART_FILE = "restart.json"
POOLS = ("prefill", "decode")


class _Stop(Exception):
    pass


def add_parsers(sub: Any) -> None:
    up = sub.add_parser("up", help="run a UCMDeployment here: store, prefill/decode vLLM, proxy")
    up.add_argument("-f", "--file", help="a UCMDeployment (YAML); default: the tiny model, a POSIX store, 1+1 engines")
    up.add_argument("--name", default="local", help="stack name (run directory .ucm/<name>)")
    up.add_argument("--run-dir", default=".ucm", help="where config, logs, blocks and state go")
    up.add_argument("--port", type=int, default=8000, help="proxy port (0: any free port)")
    up.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for every role to be ready")
    up.add_argument(
        "--monitor",
        action="store_true",
        help="also run Prometheus (Debian's prometheus) scraping the stack with UCM's rules and alerts",
    )
    up.add_argument("--monitor-port", type=int, default=9090, help="Prometheus' port (0: any free port)")
    up.set_defaults(func=cmd_up)
    down = sub.add_parser("down", help="stop a stack started with ucm up")
    down.add_argument("--name", default="local", help="the stack to stop: the --name it was started with")
    down.add_argument(
        "--run-dir", default=".ucm", help=f"the --run-dir it was started with (its state: RUN_DIR/NAME/{STATE_FILE})"
    )
    down.set_defaults(func=cmd_down)
    restart = sub.add_parser(
        "restart", help="roll engine pools of a stack started with ucm up (new engines join before old ones drain)"
    )
    restart.add_argument(
        "--role",
        choices=POOLS,
        action="append",
        help="a pool to roll (repeatable; default: both, or with -f the pools the change touches)",
    )
    restart.add_argument("-f", "--file", help="a changed UCMDeployment: its engines replace the running ones")
    restart.add_argument("--name", default="local", help="the stack to roll: the --name it was started with")
    restart.add_argument(
        "--run-dir", default=".ucm", help=f"the --run-dir it was started with (its state: RUN_DIR/NAME/{STATE_FILE})"
    )
    restart.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for the rollout")
    restart.set_defaults(func=cmd_restart)


def load_spec(path: str | None) -> tuple[UCMDeploymentSpec, bool]:
    """The spec, and whether the user gave it (the default needs no warnings)."""
    if path is None:
        from ucm.deploy.demo_model import TINY, ensure_model

        print("ucm up: preparing the tiny model (generated once, cached in ~/.cache/ucm/models)", flush=True)
        return read_spec(default_spec(ensure_model(TINY))), False
    return load_resource(path).spec, True


class Progress:
    """One rewritten status line on a terminal; plain lines otherwise (logs, CI)."""

    def __init__(self) -> None:
        self.tty = sys.stdout.isatty()
        self.t0 = time.monotonic()
        self.frame = 0

    def __call__(self, message: str, waiting: list[Process]) -> None:
        if message:
            self._line(f"ucm up: {message}")
        elif waiting and self.tty:
            self.frame += 1
            names = ", ".join(p.role.name for p in waiting)
            spinner = "|/-\\"[self.frame % 4]
            sys.stdout.write(f"\r{spinner} waiting for {names} ({time.monotonic() - self.t0:.0f} s)\033[K")
            sys.stdout.flush()

    def _line(self, text: str) -> None:
        if self.tty:
            sys.stdout.write("\r\033[K")
        print(text, flush=True)


def cmd_up(args: argparse.Namespace) -> int:
    try:
        spec, given = load_spec(args.file)
        run_dir = Path(args.run_dir).resolve() / args.name
        monitor_port = args.monitor_port if args.monitor else None
        stack = LocalStack(
            spec, run_dir, args.port, args.name, state_path=run_dir / STATE_FILE, monitor_port=monitor_port
        )
    except (ConfigError, PlanError, StackError) as exc:
        print(f"ucm up: error: {exc}", file=sys.stderr)
        return 2
    if given:
        for f in kubernetes_only_fields(spec):
            print(f"ucm up: ignoring {f}: Kubernetes only", flush=True)
    dtype = engine_dtype(spec, stack.site())
    if dtype != spec.model.dtype:
        print(
            f"ucm up: the engines run {dtype} (model.dtype {spec.model.dtype}): this CPU has no bfloat16 "
            "arithmetic (AVX512-BF16 or AMX), and vLLM's choice, bfloat16, would run ~100x slower here",
            flush=True,
        )

    def stop_signal(signum: int, _frame: object) -> None:
        raise _Stop(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # SIGHUP: the terminal went away
        signal.signal(sig, stop_signal)
    asked = []  # a restart was asked for (SIGUSR1): handled between supervision rounds
    signal.signal(signal.SIGUSR1, lambda _s, _f: asked.append(True))
    progress = Progress()
    state_file = run_dir / STATE_FILE
    try:
        stack.start(progress, timeout=args.timeout)
        _announce(stack, progress)
        while True:
            time.sleep(1.0)
            stack.supervise(lambda m: progress(m, []))
            if asked:
                asked.clear()
                _restart(stack, run_dir, progress, args.timeout)
    except _Stop as why:
        print(f"\nucm up: {why}: stopping", flush=True)
        stack.stop()
        return 0
    except StackError as exc:
        print(f"\nucm up: error: {exc}", file=sys.stderr, flush=True)
        stack.stop()
        return 1
    finally:
        state_file.unlink(missing_ok=True)


def _restart(stack: LocalStack, run_dir: Path, progress: Progress, timeout: float) -> None:
    try:
        request = json.loads((run_dir / RESTART_FILE).read_text())
        pools = [p for p in request["roles"] or POOLS if p in POOLS]
        rid, file = str(request["id"]), request.get("file")
    except (OSError, ValueError, KeyError, TypeError):
        return  # nothing readable asked for: a stray signal
    (run_dir / RESTART_FILE).unlink(missing_ok=True)
    started = time.monotonic()
    outcome: dict[str, Any] = {"id": rid, "roles": pools}
    try:
        if file is not None:
            changed = stack.reconfigure(load_spec(file)[0])
            pools = request["roles"] or changed
        if pools:
            stack.roll(pools, progress, timeout=timeout)
        message = f"rolled {', '.join(pools)}" if pools else "nothing to roll: the engines did not change"
        outcome.update(status="done", roles=pools, message=f"{message} in {time.monotonic() - started:.0f} s")
    except (StackError, ConfigError, PlanError) as exc:
        outcome.update(status="failed", message=str(exc))
    progress(f"restart: {outcome['message']}", [])
    stack.rollout = outcome
    stack.save_state()


def cmd_restart(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir).resolve() / args.name
    try:
        state = json.loads((run_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        print(f"ucm restart: no stack named {args.name!r} is running (no {run_dir / STATE_FILE})", file=sys.stderr)
        return 1
    if not same_process(state["pid"], state.get("start")):
        print(f"ucm restart: the ucm up of {args.name!r} is gone (stale {run_dir / STATE_FILE})", file=sys.stderr)
        return 1
    rid = secrets.token_hex(4)
    file = str(Path(args.file).resolve()) if args.file else None
    write_state(run_dir / RESTART_FILE, {"id": rid, "roles": args.role or [], "file": file})
    os.kill(state["pid"], signal.SIGUSR1)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        time.sleep(0.5)
        try:
            rollout = json.loads((run_dir / STATE_FILE).read_text()).get("rollout") or {}
        except (OSError, ValueError):
            rollout = {}  # being replaced, or ucm up ended
        if rollout.get("id") == rid:
            print(f"ucm restart: {rollout['message']}")
            return 0 if rollout["status"] == "done" else 1
        if not same_process(state["pid"], state.get("start")):
            print("ucm restart: ucm up exited during the rollout", file=sys.stderr)
            return 1
    print(f"ucm restart: no outcome after {args.timeout:g} s; see the logs in {run_dir / 'logs'}", file=sys.stderr)
    return 1


def _announce(stack: LocalStack, progress: Progress) -> None:
    model = stack.spec.model.served
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32})
    progress(f"ready in {time.monotonic() - progress.t0:.0f} s; logs in {stack.logs}", [])
    print(f"  try: curl -s {stack.base_url}/chat/completions -H 'Content-Type: application/json' -d '{body}'")
    adapters = [a.name for a in stack.spec.lora.adapters] if stack.spec.lora is not None else []
    if adapters:
        print(f"  LoRA adapters (a request's model): {', '.join(adapters)}")
    print("  stop: Ctrl-C, or `ucm down`")
    if stack.monitor is not None:
        print(
            f"  Prometheus: http://127.0.0.1:{stack.monitor.port} (UCM's rules and alerts; e.g. ucm_cache_hit_rate, "
            "ucm_io_throughput_gbps)"
        )
    print(f"  OpenAI base URL: {stack.base_url}", flush=True)


def cmd_down(args: argparse.Namespace) -> int:
    state_file = Path(args.run_dir).resolve() / args.name / STATE_FILE
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError):
        print(f"ucm down: no stack named {args.name!r} is running (no {state_file})")
        return 0
    launcher = (state["pid"], state.get("start"))
    if same_process(*launcher):
        _signal(state["pid"], signal.SIGTERM)
        # `ucm up` lets its engines drain; a few seconds more for its own exit.
        deadline = time.monotonic() + float(state.get("stop_timeout_s", 90)) + 10
        while same_process(*launcher) and time.monotonic() < deadline:
            time.sleep(0.2)
    # What outlived a stuck `ucm up`, and only if it is still the process that was started (a PID
    # whose process ended may belong to anything now).
    for name, role in state["roles"].items():
        for rank, process in enumerate([role, *role.get("workers", [])]):
            if same_process(process["pid"], process.get("start")):
                who = name if rank == 0 else f"{name}'s worker {rank}"
                print(f"ucm down: {who} (pid {process['pid']}) outlived ucm up; killing it")
                _signal(-process["pid"], signal.SIGKILL)
    if same_process(*launcher):
        _signal(state["pid"], signal.SIGKILL)
    state_file.unlink(missing_ok=True)
    print(f"ucm down: stopped {args.name}")
    return 0


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
