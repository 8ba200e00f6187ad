import os

import pytest
from hypothesis import settings

# The Mooncake client logs through glog at INFO by default; keep test output readable.
os.environ.setdefault("GLOG_minloglevel", "2")

# Property tests draw the same examples on every run and machine: CI passes or fails on the code,
# not on the draw or its load. Explore with HYPOTHESIS_PROFILE=explore (random examples, as many as each test asks).
settings.register_profile("ci", derandomize=True, deadline=None)  # a loaded CI machine is slow, not wrong
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def mooncake_master():
    """One real mooncake_master on loopback for the whole session."""
    from ucm_testing.mooncake import MooncakeMaster

    with MooncakeMaster() as master:
        yield master
