"""A pytest plugin for CI runs that may be cut off at a time limit: SIGTERM ends the run the way
Ctrl-C does, so pytest still tears the fixtures down (no engine outlives the run) and prints the
failures so far and the slowest tests; and each failure is named the moment it happens, so a log
cut short still says what failed and why."""

from __future__ import annotations

import signal
from types import FrameType

import pytest


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}: the run was cut off")


class _FailureLines:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if not report.failed or reporter is None:
            return
        crash = getattr(report.longrepr, "reprcrash", None)
        reason = crash.message.splitlines()[0][:300] if crash is not None and crash.message else ""
        reporter.write_line(f"\n{report.when} failed: {report.nodeid} after {report.duration:.0f} s: {reason}")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logstart() -> None:
    # A test's event loop that handled SIGTERM leaves it at SIG_DFL when it closes (asyncio's
    # remove_signal_handler does): the next SIGTERM would kill the run without its summary.
    if signal.getsignal(signal.SIGTERM) is not _interrupt:
        signal.signal(signal.SIGTERM, _interrupt)


def pytest_configure(config: pytest.Config) -> None:
    signal.signal(signal.SIGTERM, _interrupt)
    config.pluginmanager.register(_FailureLines(config), "ucm-failure-lines")
