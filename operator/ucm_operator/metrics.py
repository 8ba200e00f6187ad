"""``ucm_operator_*`` Prometheus metrics."""

from prometheus_client import Counter, Histogram

RECONCILES = Counter("ucm_operator_reconciles", "Reconciles of UCMDeployments", ["result"])
RECONCILE_SECONDS = Histogram("ucm_operator_reconcile_duration_seconds", "Time to reconcile one UCMDeployment")
WRITES = Counter("ucm_operator_child_writes", "Writes to child objects", ["kind", "verb"])
EVENTS = Counter(
    "ucm_operator_events", "Events on UCMDeployments, posted or held back by the rate limit", ["reason", "outcome"]
)
