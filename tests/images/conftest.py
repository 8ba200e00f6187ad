# The operator tests' kmock cluster (and its check of every call against the chart's ClusterRole).
from tests.operator.conftest import cluster, cluster_role_rules  # noqa: F401
