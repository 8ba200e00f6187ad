import os

from prometheus_client import REGISTRY


def blocks(n: int, size: int) -> tuple[list[bytes], list[bytes]]:
    return [os.urandom(32) for _ in range(n)], [os.urandom(size) for _ in range(n)]


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0
