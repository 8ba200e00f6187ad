"""Fixtures shared by tests/ and e2e/: the tiny model and one plain vLLM engine for the session.

The plain engine is the reference every module compares its answers with. It starts once (an
engine start is ~30 s of one core importing Python) instead of once per module, and it starts as
soon as the run knows a selected test needs it, so its start overlaps the tests before that one.
It serves the tiny model under both names the suite uses (``tiny``, as the stacks call it, and the
model's path) and holds nothing a test could leave behind but its prefix cache, which changes no
greedy token.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from ucm.deploy.demo_model import TINY, ensure_model
from ucm_testing.vllm_server import VLLMServer

_plain: list[VLLMServer] = []  # the session's plain engine, once started


def _start_plain() -> VLLMServer:
    if not _plain:
        model = ensure_model(TINY)
        log = Path(tempfile.mkdtemp(prefix="ucm-plain-")) / "vllm.log"
        _plain.append(VLLMServer(model, log, extra_args=["--served-model-name", "tiny", str(model)]).start())
    return _plain[0]


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by mark
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``engines`` (``ucm_testing.lanes``): every e2e test, and every test of the plain engine."""
    for item in items:
        if item.nodeid.startswith("e2e/") or "plain" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.engines)


def pytest_collection_finish(session: pytest.Session) -> None:
    """After every deselection (-k, -m, --lf): only the tests that will run count."""
    if session.config.option.collectonly:
        return
    if any("plain" in getattr(item, "fixturenames", ()) for item in session.items):
        _start_plain()


def pytest_sessionfinish(session: pytest.Session) -> None:
    for server in _plain:
        server.stop()
        if session.testsfailed == 0:  # otherwise its log stays, for whoever reads the failure
            shutil.rmtree(server.log_path.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The generated tiny Llama (built once per machine, ~30 s; then cached)."""
    return ensure_model(TINY)


@pytest.fixture(scope="session")
def plain() -> VLLMServer:
    """Plain vLLM (no connector, no plugin options) on the tiny model, for the whole session."""
    return _start_plain().wait_ready()
