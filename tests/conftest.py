"""Shared fixtures: long-lived rank pools of 2 and 4 gloo ranks (see tests/multirank.py)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.multirank import RankPool

os.environ.setdefault("OMP_NUM_THREADS", "1")

# The tests of what DeepSpeed, transformers and Accelerate do run on both dependency stacks (.ci/run: pytest -m stack
# on the oldest supported versions): each is marked where it is written, ``pytestmark = pytest.mark.stack`` for a
# whole file, ``@pytest.mark.stack`` for one test.
# The tests of torch's own distributed machinery (FSDP2, FSDP1, DCP, DeviceMesh, torchvision's models) run on the
# torch-next stack too (.ci/run: pytest -m torch_next on torch 2.15.0): every test under tests/fsdp gets the marker
# here, the others are marked where they are written.
_FSDP_TESTS = Path(__file__).resolve().parent / "fsdp"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _FSDP_TESTS in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.torch_next)


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
