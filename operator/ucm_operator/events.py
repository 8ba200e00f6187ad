"""Events on ``UCMDeployment`` objects (``kubectl describe ucmd``), rate-limited.

Every decision the operator makes about a deployment is posted with a reason users can grep
(the table in docs/concepts/operator.md). A loop that keeps making the same decision (a spec that
keeps failing, a child someone keeps editing) must not flood the API server's Event store, so per
object and reason: the same message again within ``SAME_S`` is not posted, and at most ``BURST``
are posted at once, one more each ``REFILL_S`` (a token bucket, as client-go's Event spam filter
keeps). What was held back is counted in the next Event posted for that object and reason, and in
``ucm_operator_events_total{outcome="suppressed"}``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from ucm_operator.metrics import EVENTS


@dataclass
class _Bucket:
    tokens: float
    at: float  # when ``tokens`` was counted
    last: dict[str, float] = field(default_factory=dict)  # message -> when it was last posted
    held: int = 0  # held back since the last Event posted


class Events:
    BURST = 10
    REFILL_S = 30.0
    SAME_S = 60.0

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[tuple[tuple[str, str], str], _Bucket] = {}  # ((namespace, name), reason)

    def post(self, owner: Mapping[str, Any], reason: str, message: str, warning: bool = False) -> bool:
        """Post (Normal, or Warning) unless the limits hold it back; True when posted."""
        now = self._clock()
        bucket = self._buckets.setdefault((_object(owner), reason), _Bucket(tokens=self.BURST, at=now))
        bucket.tokens = min(self.BURST, bucket.tokens + (now - bucket.at) / self.REFILL_S)
        bucket.at = now
        repeated = now - bucket.last.get(message, -self.SAME_S) < self.SAME_S
        if repeated or bucket.tokens < 1:
            bucket.held += 1
            EVENTS.labels(reason, "suppressed").inc()
            return False
        bucket.tokens -= 1
        bucket.last = {m: t for m, t in bucket.last.items() if now - t < self.SAME_S}
        bucket.last[message] = now
        if bucket.held:
            message += f" ({bucket.held} more Events of this reason held back by the rate limit)"
            bucket.held = 0
        (kopf.warn if warning else kopf.info)(dict(owner), reason=reason, message=message)
        EVENTS.labels(reason, "posted").inc()
        return True

    def forget(self, namespace: str, name: str) -> None:
        """The object is gone: its limits go with it."""
        for key in [k for k in self._buckets if k[0] == (namespace, name)]:
            del self._buckets[key]


def _object(owner: Mapping[str, Any]) -> tuple[str, str]:
    meta = owner.get("metadata") or {}
    return str(meta.get("namespace")), str(meta.get("name"))
