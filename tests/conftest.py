import os

import pytest

# The Mooncake client logs through glog at INFO by default; keep test output readable.
os.environ.setdefault("GLOG_minloglevel", "2")


@pytest.fixture(scope="session")
def mooncake_master():
    """One real mooncake_master on loopback for the whole session."""
    from ucm_testing.mooncake import MooncakeMaster

    with MooncakeMaster() as master:
        yield master


@pytest.fixture(scope="session")
def tiny_model():
    """The generated tiny Llama (built once per machine, ~30 s; then cached)."""
    from ucm.deploy.demo_model import TINY, ensure_model

    return ensure_model(TINY)
