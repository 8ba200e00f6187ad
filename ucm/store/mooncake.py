"""Mooncake distributed store: KV blocks in a pool of DRAM contributed by every client.

Batches go through ``batch_put_from`` / ``batch_get_into``, which move bytes between registered
memory and the pool without Python copies. Buffers inside a region given to
:meth:`MooncakeStore.register_buffer` (the connector registers its KV buffers once) are used in
place; any other buffer is staged through a registered bounce area, one copy each way.
"""

from __future__ import annotations

import logging
import mmap
import socket
import threading
from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import ByteSize, Field, field_validator

from ucm.config import ConfigError, StrictModel
from ucm.store.base import Blob, Buffer, Store, StoreError, Task, blob_size, copy_from_blob, copy_to_blob
from ucm.store.workers import IOThreads

logger = logging.getLogger(__name__)


class MooncakeConfig(StrictModel):
    master_address: str = Field(description="host:port of mooncake_master's RPC service")
    metadata_server: str = Field(description="Transfer-engine metadata URL, e.g. http://host:port/metadata")
    local_hostname: str = Field("127.0.0.1", description="Address other clients reach this one at")
    protocol: Literal["tcp", "rdma"] = Field(
        "tcp", description="The transfer engine's transport between clients: tcp, or rdma over device_name's device(s)"
    )
    device_name: str = Field("", description="RDMA device(s), protocol=rdma only")
    global_segment_size: ByteSize = Field(ByteSize(1 << 30), ge=0, description="DRAM this client adds to the pool")
    local_buffer_size: ByteSize = Field(ByteSize(128 << 20), gt=0, description="Client-side transfer buffer")
    staging_size: ByteSize = Field(ByteSize(64 << 20), gt=0, description="Registered bounce area")
    key_prefix: str = Field("ucm/", description="Prefix of every key this store writes")
    connect_timeout_s: float = Field(5.0, gt=0, description="How long to wait for the master to answer")

    @field_validator("master_address")
    @classmethod
    def _host_port(cls, v: str) -> str:
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"must be host:port, got {v!r}")
        return v


def buffer_address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class MooncakeStore(Store):
    backend = "mooncake"

    def __init__(self, config: MooncakeConfig) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise ConfigError("mooncake: the Mooncake client is not installed (pip install 'ucm[mooncake]')") from exc
        self.config = config
        # The client's own setup retries an unreachable master for about 90 s; fail fast instead.
        host, _, port = config.master_address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=config.connect_timeout_s).close()
        except OSError as exc:
            raise StoreError(
                f"mooncake: cannot join the store (master_address={config.master_address!r} "
                f"unreachable: {exc.strerror or exc})"
            ) from None
        self._client = MooncakeDistributedStore()
        rc = self._client.setup(
            config.local_hostname,
            config.metadata_server,
            int(config.global_segment_size),
            int(config.local_buffer_size),
            config.protocol,
            config.device_name,
            config.master_address,
        )
        if rc != 0:
            raise StoreError(
                f"mooncake: cannot join the store (master_address={config.master_address!r}, "
                f"metadata_server={config.metadata_server!r}; setup returned {rc})"
            )
        self._regions: list[tuple[int, int, memoryview]] = []
        self._regions_lock = threading.Lock()
        self._staging = memoryview(mmap.mmap(-1, int(config.staging_size)))
        self._staging_addr = buffer_address(self._staging)
        self.register_buffer(self._staging)
        # One batch at a time: the staging area is shared, and one batch call already fans out.
        self._pool = IOThreads(1, "ucm-mooncake")

    def _key(self, block_id: bytes) -> str:
        return self.config.key_prefix + block_id.hex()

    def register_buffer(self, buffer: Buffer) -> None:
        view = memoryview(buffer).cast("B")
        addr = buffer_address(view)
        rc = self._client.register_buffer(addr, view.nbytes)
        if rc != 0:
            raise StoreError(f"mooncake: register_buffer of {view.nbytes} bytes failed ({rc})")
        with self._regions_lock:
            self._regions.append((addr, addr + view.nbytes, view))  # the view keeps the memory alive

    def _registered(self, addr: int, size: int) -> bool:
        return any(lo <= addr and addr + size <= hi for lo, hi, _ in self._regions)

    def _lookup(self, ids: Sequence[bytes]) -> list[bool]:
        return [r == 1 for r in self._client.batch_is_exist([self._key(i) for i in ids])]

    def _dump(self, ids: Sequence[bytes], payloads: Sequence[Blob]) -> Task:
        task = Task(len(ids))
        self._pool.submit(self._transfer, task, ids, payloads, False)
        return task

    def _load(self, ids: Sequence[bytes], buffers: Sequence[Blob]) -> Task:
        task = Task(len(ids))
        self._pool.submit(self._transfer, task, ids, buffers, True)
        return task

    def _transfer(self, task: Task, ids: Sequence[bytes], views: Sequence[Blob], is_load: bool) -> None:
        ok = [False] * len(ids)
        try:
            # In place: one segment inside registered memory. Anything else goes through staging.
            addrs = [None if isinstance(v, list) else buffer_address(v) for v in views]
            direct = [k for k, a in enumerate(addrs) if a is not None and self._registered(a, blob_size(views[k]))]
            if direct:
                self._batch(is_load, ids, views, direct, [addrs[k] for k in direct], ok)
            taken = set(direct)
            staged = [k for k in range(len(ids)) if k not in taken]
            for group in self._staging_groups(staged, views):
                offsets, at = [], 0
                for k in group:
                    size = blob_size(views[k])
                    if not is_load:
                        copy_from_blob(self._staging[at : at + size], views[k])
                    offsets.append(self._staging_addr + at)
                    at += size
                self._batch(is_load, ids, views, group, offsets, ok)
                if is_load:
                    for k, addr in zip(group, offsets, strict=True):
                        if ok[k]:
                            at = addr - self._staging_addr
                            copy_to_blob(views[k], self._staging[at : at + blob_size(views[k])])
        except Exception:
            logger.exception("mooncake: batch %s failed", "load" if is_load else "dump")
        task._set(range(len(ids)), ok)

    def _batch(
        self,
        is_load: bool,
        ids: Sequence[bytes],
        views: Sequence[Blob],
        which: list[int],
        addrs: list[int],
        ok: list[bool],
    ) -> None:
        keys = [self._key(ids[k]) for k in which]
        sizes = [blob_size(views[k]) for k in which]
        if is_load:
            results = self._client.batch_get_into(keys, addrs, sizes)
            for k, size, r in zip(which, sizes, results, strict=True):
                ok[k] = r == size
        else:
            results = self._client.batch_put_from(keys, addrs, sizes)
            for k, r in zip(which, results, strict=True):
                ok[k] = r == 0
        failed = [(keys[j], r) for j, r in enumerate(results) if not ok[which[j]]]
        if failed and not is_load:
            logger.warning("mooncake: %d puts failed, first %s -> %s", len(failed), *failed[0])

    def _staging_groups(self, which: list[int], views: Sequence[Blob]) -> list[list[int]]:
        """Split blocks into groups that fit the staging area; a block bigger than it fails."""
        groups: list[list[int]] = []
        current: list[int] = []
        used = 0
        cap = self._staging.nbytes
        for k in which:
            size = blob_size(views[k])
            if size > cap:
                logger.warning("mooncake: a %d-byte block exceeds staging_size=%d; not transferred", size, cap)
                continue
            if used + size > cap:
                groups.append(current)
                current, used = [], 0
            current.append(k)
            used += size
        if current:
            groups.append(current)
        return groups

    def remove(self, ids: Sequence[bytes]) -> list[bool]:
        # force: skip Mooncake's read leases; a reader mid-transfer then fails that block (a miss).
        return [r == 0 for r in self._client.batch_remove([self._key(i) for i in ids], True)]

    def close(self) -> None:
        if self._pool.close():
            self._client.close()
        # else a transfer is still inside the client: closing it under that call could crash the
        # process; the client is left to the process's exit.
