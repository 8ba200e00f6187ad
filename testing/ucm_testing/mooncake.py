"""A real ``mooncake_master`` on loopback (with its HTTP metadata server), for tests and benchmarks."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from ucm.deploy.ports import free_port, wait_for_port
from ucm_testing.processes import stop_process


def master_binary() -> str:
    """The master shipped in the Mooncake wheel (also on PATH as ``mooncake_master`` in a venv)."""
    import mooncake

    packaged = Path(mooncake.__file__).parent / "mooncake_master"
    if packaged.exists():
        return str(packaged)
    found = shutil.which("mooncake_master")
    if found is None:
        raise FileNotFoundError("mooncake_master not found: install mooncake-transfer-engine(-non-cuda)")
    return found


class MooncakeMaster:
    """Starts the master on free ports; stop() (or the context manager) ends it by PID."""

    def __init__(self) -> None:
        self.rpc_port = free_port()
        self.metadata_port = free_port()
        self.metrics_port = free_port()
        self._log = tempfile.NamedTemporaryFile(prefix="mooncake-master-", suffix=".log", delete=False)  # noqa: SIM115 - lives as long as the master
        self.log_path = self._log.name
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    def store_options(self, **overrides: Any) -> dict[str, Any]:
        """Options for the ``mooncake`` store stage that reach this master."""
        return {"master_address": self.master_address, "metadata_server": self.metadata_server, **overrides}

    def start(self, timeout: float = 30.0) -> MooncakeMaster:
        args = [
            master_binary(),
            "-rpc_address=127.0.0.1",
            f"-rpc_port={self.rpc_port}",
            "-enable_http_metadata_server=true",
            "-http_metadata_server_host=127.0.0.1",
            f"-http_metadata_server_port={self.metadata_port}",
            "-metrics_host=127.0.0.1",
            f"-metrics_port={self.metrics_port}",
            "-enable_metric_reporting=false",
        ]
        self._proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        for port in (self.rpc_port, self.metadata_port):
            if not wait_for_port("127.0.0.1", port, timeout):
                self.stop()
                raise RuntimeError(f"mooncake_master did not listen on {port}; see {self.log_path}")
        return self

    def stop(self) -> None:
        if self._proc is not None:
            stop_process(self._proc)
        self._log.close()

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        os.unlink(self.log_path)
