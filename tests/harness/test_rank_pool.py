"""Self-tests of the multi-rank harness: failures are fast and attributed, hangs are cut, the pool recovers."""
from __future__ import annotations

import time

import pytest

from tests.multirank import RankFailure


def _rank_and_sum(rank, world):
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, dist.get_world_size(), t.item()


def _rank1_raises_while_peers_block(rank, world):
    import torch
    import torch.distributed as dist
    if rank == 1:
        raise ValueError("boom from rank one")
    dist.all_reduce(torch.ones(1))  # peers block here: rank 1 never joins


def _rank0_hangs(rank, world):
    import threading
    if rank == 0:
        threading.Event().wait()  # never set: a hang
    return rank


def _rank1_skips(rank, world):
    if rank == 1:
        pytest.skip("rank 1 has no GPU")
    return rank


def _rank1_dies(rank, world):
    import os

    import torch
    import torch.distributed as dist
    if rank == 1:
        os._exit(7)
    dist.all_reduce(torch.ones(1))


def test_runs_on_every_rank_and_returns_by_rank(ranks):
    out = ranks.run(_rank_and_sum)
    n = ranks.world_size
    assert out == [(r, n, float(sum(range(n)))) for r in range(n)]


def test_rank_that_raises_fails_fast_with_its_traceback(ranks2):
    started = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 of 2 raised") as info:
        ranks2.run(_rank1_raises_while_peers_block, timeout=60)
    assert time.monotonic() - started < 10
    assert "boom from rank one" in str(info.value) and "Traceback" in str(info.value)
    assert ranks2.run(_rank_and_sum)[1] == (1, 2, 1.0)  # the next call gets a rebuilt pool


def test_hang_is_cut_by_the_deadline_and_reported(ranks2):
    started = time.monotonic()
    with pytest.raises(RankFailure, match=r"deadline passed; rank\(s\) \[0\] did not finish") as info:
        ranks2.run(_rank0_hangs, timeout=2)
    assert time.monotonic() - started < 10
    assert "stack of rank 0" in str(info.value) and "_rank0_hangs" in str(info.value)
    assert ranks2.run(_rank_and_sum)[0] == (0, 2, 1.0)


def test_dead_rank_is_reported(ranks2):
    with pytest.raises(RankFailure, match=r"rank\(s\) \[1\] died \(exit codes \{1: 7\}\)"):
        ranks2.run(_rank1_dies, timeout=30)
    assert ranks2.run(_rank_and_sum)[1][2] == 1.0


def test_skip_on_one_rank_skips_the_test(ranks2):
    with pytest.raises(pytest.skip.Exception, match="rank 1 has no GPU"):
        ranks2.run(_rank1_skips)
    starts = ranks2.starts
    assert ranks2.run(_rank_and_sum)[0][2] == 1.0
    assert ranks2.starts == starts  # a clean skip does not cost a rebuild


def test_pool_is_reused_between_calls(ranks2):
    ranks2.run(_rank_and_sum)
    starts = ranks2.starts
    for _ in range(3):
        ranks2.run(_rank_and_sum)
    assert ranks2.starts == starts


def _rank1_dies_or_stalls(rank, world, how):
    import os
    import threading
    if rank == 1:
        if how == "die":
            os._exit(5)
        threading.Event().wait()  # never set: a stall
    return f"rank {rank} done"


@pytest.mark.parametrize("how", ["die", "stall"])
def test_allow_dead_returns_the_survivors_and_rebuilds_the_pool(ranks2, how):
    started, starts = time.monotonic(), ranks2.starts
    out = ranks2.run(_rank1_dies_or_stalls, how, allow_dead=[1], timeout=30)
    assert out == ["rank 0 done", None]
    assert time.monotonic() - started < 10  # a stalled listed rank is not waited for until the deadline
    assert not ranks2.alive  # the listed rank was killed (if it still ran) and the pool is torn down
    assert ranks2.run(_rank_and_sum) == [(0, 2, 1.0), (1, 2, 1.0)]
    assert ranks2.starts == starts + 1


def test_allow_dead_still_fails_on_errors_and_on_unlisted_deaths(ranks2):
    with pytest.raises(RankFailure, match="rank 1 of 2 raised"):  # a listed rank may die, not raise
        ranks2.run(_rank1_raises_while_peers_block, allow_dead=[1], timeout=30)
    with pytest.raises(RankFailure, match=r"rank\(s\) \[1\] died"):
        ranks2.run(_rank1_dies, allow_dead=[0], timeout=30)
    with pytest.raises(ValueError, match="proper subset"):
        ranks2.run(_rank_and_sum, allow_dead=[0, 1])
    assert ranks2.run(_rank_and_sum)[0] == (0, 2, 1.0)


# ---- the table helpers (tests/helpers.py): many cases in one task, every failing case named ----------------------
def test_check_table_names_every_failing_case():
    from tests.helpers import check_table

    per_rank = [{"ok": {"v": 1}, "bad": {"v": 2}, "worse": {"v": 3}, "crash": {"crashed": "ValueError: boom"}},
                {"ok": {"v": 1}, "bad": {"v": 2}, "worse": {"v": 3}, "crash": {"v": 0}}]

    def check(name, res):
        assert res[0]["v"] == 1, f"v={res[0]['v']}"

    with pytest.raises(AssertionError) as info:
        check_table(["ok", "bad", "worse", "crash", "never run"], per_rank, check)
    text = str(info.value)
    assert text.startswith("4 of 5 cases failed:\n"), text
    assert "bad: v=2" in text and "worse: v=3" in text and "\nok:" not in text, text
    assert "crash: the case itself crashed on rank 0: ValueError: boom" in text, text
    assert "never run: not run on rank(s) [0, 1]" in text, text
    check_table(["ok"], per_rank, check)  # nothing failing: no error


def _tables(rank, world, desync):
    import tests.helpers as helpers

    helpers.FENCE_SECONDS = 2.0  # this worker is thrown away afterwards

    def case(name):
        if desync and name == "b" and rank == 0:  # rank 0 enters a collective its peer never issues
            import torch
            import torch.distributed as dist
            dist.all_gather([torch.empty(7, dtype=torch.int32) for _ in range(world)],
                            torch.full((7,), 99, dtype=torch.int32), async_op=True)
        return {"rank": rank, "case": name}

    return helpers.run_table(world, ["a", "b", "c"], case)


def test_run_table_runs_every_case_and_stops_where_ranks_fall_out_of_step(ranks2):
    out = ranks2.run(_tables, False)
    assert out == [{n: {"rank": r, "case": n} for n in "abc"} for r in range(2)]
    out = ranks2.run(_tables, True, allow_dead=[1], timeout=60)  # the group is suspect afterwards: rebuild it
    assert out[0]["<desynchronised>"] == "b" and "c" not in out[0], out
