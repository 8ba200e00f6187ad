"""``type: mooncake``: Mooncake's distributed DRAM pool, each engine contributing a segment; its
master runs in the deployment (``master``) or outside it (``address``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from ucm.deploy.roles import Port, Probe, Role, Site, fail, quantity_bytes
from ucm.deploy.schema import Quantity, Spec, cel
from ucm.deploy.stores.base import StoreKind

MASTER = "mooncake-master"
METRICS_PORT = 9003


class MooncakeMaster(Spec):
    image: str | None = Field(
        None,
        description="Default: the runtime image (it ships mooncake_master), its CPU flavour when no engine "
        "pool has GPUs",
    )
    port: int = Field(50051, ge=1, le=65535, description="The master's RPC port (`ucm up` picks a free one)")
    metadata_port: int = Field(
        8080, ge=1, le=65535, description="The master's HTTP metadata server's port (`ucm up` picks a free one)"
    )


class MooncakeSpec(Spec):
    model_config = Spec.model_config | cel(
        ("self.protocol == 'rdma' || !has(self.deviceName)", "store.mooncake.deviceName: only with protocol rdma"),
    )

    master: MooncakeMaster | None = Field(None, description="Run a master in the deployment")
    address: str | None = Field(None, description="An external master, host:port")
    metadata_server: str | None = Field(None, description="With address: its metadata URL")
    segment_size: Quantity = Field(
        "4Gi",
        description="DRAM each rank's process adds to the pool: a pod running tensor x pipeline / nodes "
        "ranks adds that many times this",
    )
    protocol: Literal["tcp", "rdma"] = Field("tcp", description="How engines move blocks to and from the pool")
    device_name: str | None = Field(
        None, min_length=1, description="RDMA device(s) to use, e.g. mlx5_0 (protocol rdma only)"
    )

    @model_validator(mode="after")
    def _device_with_rdma(self) -> MooncakeSpec:
        if self.device_name is not None and self.protocol != "rdma":
            raise ValueError("store.mooncake.deviceName: only with protocol rdma")
        return self


class Mooncake(StoreKind):
    name = "mooncake"
    field = "mooncake"
    options = MooncakeSpec
    description = "The Mooncake pool (type mooncake)"

    def connector(self, opts: MooncakeSpec, deployment: str, site: Site) -> dict[str, Any]:
        if (opts.master is None) == (opts.address is None):
            raise fail("store.mooncake", "set exactly one of master (run one here) or address (an external one)")
        if opts.master is not None:
            host = site.host(deployment, MASTER)
            rpc = site.port(MASTER, opts.master.port)
            metadata = site.port(f"{MASTER}/metadata", opts.master.metadata_port)
            address, metadata_url = f"{host}:{rpc}", f"http://{host}:{metadata}/metadata"
        else:
            if not opts.metadata_server:
                raise fail("store.mooncake.metadataServer", "required with address (the master's metadata URL)")
            address, metadata_url = opts.address or "", opts.metadata_server
        return {
            "mooncake": {
                "master_address": address,
                "metadata_server": metadata_url,
                # Other clients reach this pod at its own IP: `ucm serve` expands the variable.
                "local_hostname": "127.0.0.1" if site.local else "${POD_IP}",
                "global_segment_size": quantity_bytes(opts.segment_size, "store.mooncake.segmentSize"),
                "protocol": opts.protocol,
                **({"device_name": opts.device_name} if opts.device_name else {}),
            }
        }

    def roles(self, opts: MooncakeSpec, deployment: str, site: Site) -> list[Role]:
        if opts.master is None:
            return []
        # Same ports as connector(): a local site hands out one port per name, the same each time.
        rpc = site.port(MASTER, opts.master.port)
        metadata = site.port(f"{MASTER}/metadata", opts.master.metadata_port)
        metrics = site.port(f"{MASTER}/metrics", METRICS_PORT)
        bind = site.bind
        return [
            Role(
                name=MASTER,
                component=MASTER,
                command=[
                    "mooncake_master",
                    f"-rpc_address={bind}",
                    f"-rpc_port={rpc}",
                    "-enable_http_metadata_server=true",
                    f"-http_metadata_server_host={bind}",
                    f"-http_metadata_server_port={metadata}",
                    f"-metrics_host={bind}",
                    f"-metrics_port={metrics}",
                    "-enable_metric_reporting=false",
                ],
                ports=[Port("rpc", rpc), Port("metadata", metadata), Port("metrics", metrics)],
                readiness=Probe("rpc"),
                liveness=Probe("rpc", period_s=10),
                image=opts.master.image,
            )
        ]

    def external(self, opts: MooncakeSpec) -> str | None:
        return f"external master {opts.address}" if opts.address else None

    def kubernetes_only(self, opts: MooncakeSpec) -> list[str]:
        return ["store.mooncake.master.image"] if opts.master is not None and opts.master.image else []
