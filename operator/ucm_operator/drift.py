"""Drift: a child's live object against what the operator rendered for it.

The operator owns the fields it renders, nothing else, as server-side apply would count a field
manager's fields: a field it sets must hold its value; a field it does not set (an HPA's or
KEDA's ``replicas``, an annotation another controller adds, a container a mutating webhook
injects, the API server's defaults) is someone else's. Lists of named items (containers, env,
ports, volumes) are matched by name, so an item someone added stays; other lists (``args``,
``command``) are owned whole.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

MISSING = object()

# Kinds whose fields are not put back: a claim may be resized (expanded) by its user, and its spec
# is otherwise immutable; one deleted is still recreated.
NOT_REVERTED = {"PersistentVolumeClaim"}


def drifted(want: Any, have: Any, path: str = "") -> list[str]:
    """The paths (``spec.template.spec.containers[engine].image``) where ``have`` does not hold
    what ``want`` sets."""
    if isinstance(want, dict):
        if not isinstance(have, dict):
            return [path or "."]
        return [p for key, value in want.items() for p in drifted(value, have.get(key, MISSING), _join(path, key))]
    if isinstance(want, list):
        if not isinstance(have, list):
            return [path]
        if want and all(isinstance(item, dict) and "name" in item for item in want):
            named = {item.get("name"): item for item in have if isinstance(item, dict)}
            return [
                p for item in want for p in drifted(item, named.get(item["name"], MISSING), f"{path}[{item['name']}]")
            ]
        if len(want) != len(have):
            return [path]
        return [p for i, (w, h) in enumerate(zip(want, have, strict=True)) for p in drifted(w, h, f"{path}[{i}]")]
    return [] if want == have else [path]


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


@dataclass
class Reverts:
    """How often one child was put back: a child someone keeps changing is fought with backoff,
    not in a hot loop."""

    times: deque[float] = field(default_factory=lambda: deque(maxlen=8))
    retry_at: float = 0.0  # while backing off: when to look again (monotonic)

    WINDOW_S = 60.0
    FIGHT = 3  # reverts within WINDOW_S that make a fight
    FIRST_DELAY_S = 10.0
    MAX_DELAY_S = 300.0

    def delay(self, now: float | None = None) -> float:
        """0: revert now. Otherwise the seconds to wait before the next revert."""
        now = time.monotonic() if now is None else now
        recent = [t for t in self.times if now - t < self.WINDOW_S]
        if len(recent) < self.FIGHT:
            return 0.0
        return min(self.FIRST_DELAY_S * 2 ** (len(recent) - self.FIGHT), self.MAX_DELAY_S)

    def record(self, now: float | None = None) -> None:
        self.times.append(time.monotonic() if now is None else now)

    def calm_in(self, now: float | None = None) -> float:
        """Seconds until ``delay`` is 0 again if no revert comes meanwhile (0: not fighting)."""
        now = time.monotonic() if now is None else now
        recent = [t for t in self.times if now - t < self.WINDOW_S]
        if len(recent) < self.FIGHT:
            return 0.0
        return recent[-self.FIGHT] + self.WINDOW_S - now
