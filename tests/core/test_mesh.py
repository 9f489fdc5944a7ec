"""Multi-dimensional meshes ([Note: placements]): ``group=mesh`` (2x2, dp x tp, at world 4) checks and syncs a plain
buffer over every dimension; ``buffer_report`` names the mesh dimensions along which it disagrees and the coordinates
of the ranks that hold another value; every rank reaches the same collectives, and a failure on one rank of one line
aborts every rank of the mesh."""
from __future__ import annotations

import torch
from torch import nn

import zero_buffers as zb
from tests.helpers import bitwise_equal

TIMEOUT = 180.0


class _Block(nn.Module):
    """A tensor-parallel block's replicated state: a rotary table and a step counter, plain buffers on every rank."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)))
        self.register_buffer("step", torch.tensor(7, dtype=torch.int64))


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))  # [[0, 1], [2, 3]]: rank = 2 * dp + tp


def _drift(rank, world, drifted):
    mesh = _mesh()
    block = _Block()
    if rank in drifted:  # e.g. a TP rank that recomputed its table in another precision
        block.inv_freq.mul_(1 + 1e-3)
    report = zb.buffer_report(block, group=mesh)
    text = report.format()
    fixed = zb.broadcast_buffers(block, group=mesh)
    after = zb.buffer_report(block, group=mesh)
    row = next(r for r in report.rows if r.name == "inv_freq")
    return {"row": (row.in_sync, row.differing_ranks, row.mesh_dims, row.coordinates), "text": text,
            "fixed": fixed, "after": after.in_sync, "value": block.inv_freq.clone(),
            "step": [r.in_sync for r in report.rows if r.name == "step"]}


def test_a_plain_buffer_drifted_on_one_tp_rank_is_reported_with_its_mesh_coordinates_and_fixed(ranks4):
    out = ranks4.run(_drift, (3,), timeout=TIMEOUT)
    for o in out:  # rank 3 is (dp=1, tp=1): it differs from its tp neighbour (rank 2) and its dp neighbour (rank 1)
        assert o["row"] == (False, (3,), ("dp", "tp"), ((1, 1),)), o["row"]
        assert "(dp=1, tp=1)" in o["text"] and o["step"] == [True], o["text"]
        assert o["fixed"] == 2 and o["after"]
        assert bitwise_equal(o["value"], out[0]["value"])


def test_a_buffer_drifted_on_a_whole_tp_coordinate_names_only_the_tp_dimension(ranks4):
    out = ranks4.run(_drift, (1, 3), timeout=TIMEOUT)  # tp=1 on both dp rows: the dp lines agree, the tp lines do not
    for o in out:
        assert o["row"] == (False, (1, 3), ("tp",), ((0, 1), (1, 1))), o["row"]
        assert "along tp" in o["text"], o["text"]
        assert o["after"]


def _costs(rank, world):
    from tests.helpers import log_collectives, restore_collectives
    mesh = _mesh()
    block = _Block()
    zb.buffer_report(block, group=mesh)  # warm: the lines' groups exist already (init_device_mesh made them)
    out = {}
    for name, call in (("report", lambda: zb.buffer_report(block, group=mesh)),
                       ("broadcast", lambda: zb.broadcast_buffers(block, group=mesh))):
        log: list = []
        real = log_collectives(log)
        try:
            call()
        finally:
            restore_collectives(real)
        out[name] = log
    return out


def test_plain_buffers_over_a_mesh_cost_what_they_cost_over_the_world(ranks4):
    """In sync: one all_gather of 3 int64 for the report; broadcast: the agreement, one broadcast per dtype bucket
    over the whole group (not one per dimension), the received vote."""
    out = ranks4.run(_costs, timeout=TIMEOUT)
    for o in out:
        assert o["report"] == [("all_gather", "torch.int64", 3)], o["report"]
        assert o["broadcast"] == [("all_gather", "torch.int64", 3), ("broadcast", "torch.float32", 4),
                                  ("broadcast", "torch.int64", 1), ("all_gather", "torch.int64", 1)], o["broadcast"]


def _three_dims(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    m = _Block()
    m.register_buffer("stage", DTensor.from_local(torch.ones(2), mesh, [Shard(0), Replicate(), Replicate()],
                                                  run_check=False))
    try:
        zb.sync_buffers(m, group=mesh)
    except zb.InvalidArgumentError as e:
        return str(e)
    return None


def test_a_class_of_two_dimensions_of_a_3d_mesh_is_refused_by_name_on_every_rank(ranks4):
    out = ranks4.run(_three_dims, timeout=TIMEOUT)
    assert out[0] is not None and all(o == out[0] for o in out), out
    assert "'stage'" in out[0] and "['dp', 'tp'] together" in out[0], out[0]
