"""Scaffolding for tests, end-to-end tests and benchmarks (never shipped): real and fake servers on
loopback, the operator on kmock, prompt sets for the demo model."""
