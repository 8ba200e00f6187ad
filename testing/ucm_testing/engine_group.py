"""One engine as the operator renders it, run on loopback: the decode pool's command for a
single-pod engine, or the leader's and the workers' commands for an engine spread over ``nodes``
pods (a LeaderWorkerSet), with what Kubernetes and the LeaderWorkerSet controller fill in filled in
for this machine (the model's mount, the config file, the address and port, the worker's index).
Each process is pinned to its own cores, as each pod has its own."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ucm.deploy.plan import KV_CONFIG_FILE, LEADER_ADDRESS, MODEL_MOUNT, WORKER_INDEX, build_plan
from ucm.deploy.ports import free_port
from ucm.deploy.roles import Site
from ucm.deploy.spec import UCMDeploymentSpec
from ucm_testing.vllm_server import VLLMServer


def rendered_commands(
    model: Path, kv_config: Path, port: int, model_spec: dict[str, Any], tensor: int, nodes: int
) -> list[list[str]]:
    """The commands of one decode engine's pods, leader first."""
    spec = UCMDeploymentSpec.model_validate(
        {
            "model": {"source": {"hostPath": str(model)}, **model_spec},
            "prefill": {"parallel": {"tensor": tensor}, "resources": {"gpus": 0}},
            "decode": {"parallel": {"tensor": tensor, "nodes": nodes}, "resources": {"gpus": 0}, "drainTimeoutS": 0},
            "store": {"type": "posix", "pvc": {"claimName": "kv"}},
        }
    )
    role = build_plan("local", spec, Site("kubernetes")).role("decode")
    fill = {
        "ucm": str(Path(sys.executable).parent / "ucm"),
        f"/etc/ucm/{KV_CONFIG_FILE}": str(kv_config),
        MODEL_MOUNT: str(model),  # where a pod mounts the hostPath model
        "0.0.0.0": "127.0.0.1",
        "8000": str(port),
        LEADER_ADDRESS: "127.0.0.1",
    }
    commands = [[fill.get(a, a) for a in role.command]]
    if role.group is not None:
        for rank in range(1, nodes):
            commands.append([fill.get(a, str(rank) if a == WORKER_INDEX else a) for a in role.group.worker_command])
        # Pods have an address each and use vLLM's default rendezvous port; groups on one machine
        # share an address, so each takes a port of its own.
        rendezvous = ["--master-port", str(free_port())]
        commands = [[*c, *rendezvous] for c in commands]
    return commands


class EngineGroup:
    """``with EngineGroup(...) as leader:`` the leader serves (a VLLMServer) once every pod runs."""

    def __init__(
        self,
        model: Path,
        kv_config: Path,
        logs: Path,
        name: str,
        *,
        model_spec: dict[str, Any],
        tensor: int = 1,
        nodes: int = 1,
        cores: list[str],
        kv_cache_gib: float = 0.25,
    ) -> None:
        if len(cores) != nodes:
            raise ValueError(f"cores: one binding per node ({nodes}), got {cores}")
        port = free_port()
        commands = rendered_commands(model, kv_config, port, model_spec, tensor, nodes)
        self.pods = []
        for i, (command, bind) in enumerate(zip(commands, cores, strict=True)):
            pod = VLLMServer(
                model,
                logs / f"{name}-{i}.log",
                port=port if i == 0 else None,
                threads_bind=bind,
                kv_cache_gib=kv_cache_gib,
            )
            pod.args = command
            self.pods.append(pod)

    @property
    def leader(self) -> VLLMServer:
        return self.pods[0]

    def __enter__(self) -> VLLMServer:
        for pod in reversed(self.pods):  # workers first: the leader waits for them
            pod.start()
        try:
            self.leader.wait_ready(timeout=400)
        except BaseException:
            self.__exit__()
            raise
        return self.leader

    def __exit__(self, *_: object) -> None:
        for pod in self.pods:
            pod.stop()
