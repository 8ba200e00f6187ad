"""Where vLLM engines publish their KV cache events (``--kv-events-config``) and where ucm-proxy
looks for them: one naming for the deployment that configures both sides and for the proxy.

In a pod, fixed ports (vLLM binds its publisher and replay sockets to ``tcp://*:PORT``). On one
machine (``ucm up``), abstract-namespace sockets named by deployment and the engine's HTTP port: no
path to outgrow, nothing left behind, and unlike ``tcp://*`` not reachable from other machines.
"""

from __future__ import annotations

KV_EVENTS_PORT = 5557
KV_REPLAY_PORT = 5558
KV_EVENTS_TOPIC = "kv-events"  # the proxy's routing.kv_events.topic default


def ipc_event_endpoints(name: str, port: int) -> tuple[str, str]:
    """The publisher and replay endpoints of the engine of deployment ``name`` serving on ``port``."""
    return f"ipc://@ucm-{name}-{port}-kv-events", f"ipc://@ucm-{name}-{port}-kv-replay"
