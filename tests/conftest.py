"""Shared fixtures: long-lived rank pools of 2 and 4 gloo ranks (see tests/multirank.py)."""
from __future__ import annotations

import os

import pytest

from tests.multirank import RankPool

os.environ.setdefault("OMP_NUM_THREADS", "1")

# The tests of what DeepSpeed, transformers and Accelerate do, run on both dependency stacks by .ci/run
# (pytest -m stack on the oldest supported versions): these files, and tests elsewhere marked @pytest.mark.stack.
STACK_FILES = {"test_zero3_sync.py", "test_zero3_edges.py", "test_zero3_carveout.py", "test_gathered_dropin.py",
               "test_frozen_replica.py", "test_checkpoint.py", "test_no_holes.py", "test_real_models.py",
               "test_versions.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in STACK_FILES:
            item.add_marker(pytest.mark.stack)


@pytest.fixture(scope="session")
def pools():
    """Pools are created on first use and shut down at the end of the session."""
    made: dict[int, RankPool] = {}
    yield lambda n: made.setdefault(n, RankPool(n))
    for pool in made.values():
        pool.shutdown()


@pytest.fixture(params=[2, 4], ids=["world2", "world4"])
def ranks(request, pools) -> RankPool:
    """A pool of 2, then of 4, ranks."""
    return pools(request.param)


@pytest.fixture
def ranks2(pools) -> RankPool:
    return pools(2)


@pytest.fixture
def ranks4(pools) -> RankPool:
    return pools(4)
