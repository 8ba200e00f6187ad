"""Helpers for tests, benchmarks and the local stack: real servers on loopback, generated models."""
