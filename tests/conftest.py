import os

import pytest

# The Mooncake client logs through glog at INFO by default; keep test output readable.
os.environ.setdefault("GLOG_minloglevel", "2")


@pytest.fixture(scope="session")
def mooncake_master():
    """One real mooncake_master on loopback for the whole session."""
    from ucm.testing.mooncake import MooncakeMaster

    with MooncakeMaster() as master:
        yield master
