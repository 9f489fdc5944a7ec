"""buffer_report / assert_buffers_in_sync and dtypes, on 2 and 4 real gloo ranks: a buffer held in another dtype on
some ranks is a row of the report (out of sync, each rank's dtype, values still compared in float64), not a structure
error; a buffer held below its declared dtype ([Note: declared precision]) is flagged on its row and in the advice,
at no extra collective; a failure on one rank in the new path still ends the call on every rank."""
from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

import zero_buffers as zb
from tests.helpers import buffers, logged_call, same_state

# 0.1-step values, most of which bfloat16 cannot hold: a rank holding them in bfloat16 differs by its rounding
VALUES = (torch.linspace(-3, 3, 7, dtype=torch.float64) / 3 + 0.1)


def _low(rank: int) -> bool:
    """The ranks that hold the statistics in 16 bits (every odd one: 1, or 1 and 3)."""
    return rank % 2 == 1


def _drift_model(rank: int, world: int) -> nn.Module:
    """BatchNorm statistics in float32, in bfloat16 on the odd ranks; an int64 counter held as float32 there (equal
    values); an empty buffer whose dtype differs; a buffer that agrees; one whose values differ on the last rank."""
    m = nn.Module()
    m.bn = nn.BatchNorm1d(7)
    with torch.no_grad():
        m.bn.running_mean.copy_(VALUES.float())
        m.bn.running_var.copy_((VALUES.abs() + 1).float())
    low = _low(rank)
    if low:
        m.bn.to(torch.bfloat16)  # what an engine's cast does; num_batches_tracked stays int64
    m.register_buffer("count", torch.tensor([3.0, 5.0, 7.0]) if low else torch.tensor([3, 5, 7]))
    m.register_buffer("empty", torch.zeros(0, dtype=torch.float16 if low else torch.float32))
    m.register_buffer("same", torch.ones(4))
    m.register_buffer("codebook", torch.full((4,), float(rank == world - 1)))
    return m


def _drift(rank, world):
    from zero_buffers._core import transaction as _transaction

    model = _drift_model(rank, world)
    before = buffers(model)
    out = {"report": logged_call(lambda: zb.buffer_report(model)),
           "atol": zb.buffer_report(model, atol=2.0),
           "assert": logged_call(lambda: zb.assert_buffers_in_sync(model)),
           "mine": {n: b.clone() for n, b in model.named_buffers()}}
    real = _transaction.reached
    for phase in ("prepare", "exchange"):  # a failure on the last rank in the dtype-drift path: every rank raises
        def fail(at, what, phase=phase):
            if at.value == phase:
                raise RuntimeError(f"injected at {phase} on rank {rank}")
            real(at, what)
        if rank == world - 1:
            _transaction.reached = fail
        try:
            out[phase] = logged_call(lambda: zb.buffer_report(model))["error"]
        finally:
            _transaction.reached = real
    out["again"] = zb.buffer_report(model)  # and the next call works
    out["unchanged"] = same_state(before, buffers(model))
    return out


def test_a_buffer_in_another_dtype_on_some_ranks_is_a_row_compared_in_float64_not_a_structure_error(ranks):
    world = ranks.world_size
    out = ranks.run(_drift, timeout=90)
    low = tuple(r for r in range(world) if _low(r))
    report = out[0]["report"]["value"]
    assert all(o["report"]["error"] is None for o in out), [o["report"]["error"] for o in out]
    assert all(o["report"]["value"] == report and o["again"] == report for o in out)  # the same on every rank
    rows = {r.name: r for r in report.rows}
    mine = out[0]["mine"]
    for name in ("bn.running_mean", "bn.running_var"):  # float64 reference: what bfloat16 made of rank 0's values
        x = mine[name].double()
        want = float((x.to(torch.bfloat16).double() - x).abs().max())
        row = rows[name]
        assert want > 0 and row.max_abs_diff == want, (name, row.max_abs_diff, want)
        assert row.max_rel_diff == pytest.approx(want / float(x.abs().max()), rel=1e-12)
        assert not row.in_sync and row.differing_ranks == low and row.dtype == "float32", row
        assert row.rank_dtypes == tuple((r, "bfloat16") for r in low), row
        assert row.degraded_ranks == low and row.declared == "float32" and row.why == "BatchNorm statistics", row
    assert rows["count"].rank_dtypes == tuple((r, "float32") for r in low) and rows["count"].dtype == "int64"
    assert rows["empty"].rank_dtypes == tuple((r, "float16") for r in low)  # no bytes, still another dtype
    for name in ("count", "empty"):  # equal values, another dtype: out of sync, a difference of 0
        assert not rows[name].in_sync and rows[name].max_abs_diff == 0 and rows[name].differing_ranks == low
    assert rows["same"].in_sync and rows["bn.num_batches_tracked"].in_sync and not rows["same"].rank_dtypes
    assert rows["codebook"].differing_ranks == (world - 1,) and rows["codebook"].max_abs_diff == 1.0
    assert not rows["codebook"].rank_dtypes and not rows["codebook"].degraded_ranks
    # atol covers values, not dtypes: the codebook is within it, every row in another dtype stays out of sync
    atol_rows = {r.name: r for r in out[0]["atol"].rows}
    assert atol_rows["codebook"].in_sync and {r.name for r in out[0]["atol"].out_of_sync} == {
        "bn.running_mean", "bn.running_var", "count", "empty"}
    # the same collectives on every rank whatever its dtypes: the digests' all_gather carries a byte per buffer
    # (7 buffers: 7 digests + 1 word of dtype bytes + the declarations' digest + failed), rank 0's copy of the
    # differing buffers travels in rank 0's dtypes, in model order (int64: 3; float32: 4 + 7 + 7; the empty one not
    # at all)
    want_log = [("all_gather", "torch.int64", 3), ("all_gather", "torch.int64", 10),
                ("broadcast", "torch.int64", 3), ("broadcast", "torch.float32", 18),
                ("all_gather", "torch.float64", 4 * 5 + 2)]
    assert [o["report"]["log"] for o in out] == [want_log] * world
    text = str(report)
    dtype_text = f"float32 ({'rank 1' if world == 2 else 'ranks 1, 3'}: bfloat16)"
    assert re.search(rf"\nbn\.running_mean +{re.escape(dtype_text)} ", text) and len(text.splitlines()) < 40, text
    errors = [o["assert"]["error"] for o in out]
    assert all(e is not None and e[:2] == errors[0][:2] for e in errors), errors
    typ, message = errors[0][:2]
    assert typ == "BuffersOutOfSyncError" and dtype_text in message, message
    held = "int64 on rank 0; float32 on rank 1" if world == 2 else "int64 on ranks 0, 2; float32 on ranks 1, 3"
    assert f"'count' (and 3 more buffers) is held in different dtypes across ranks ({held})" in message, message
    assert "adopt_dtype=True" in message and "keep_precision" in message, message
    for phase in ("prepare", "exchange"):
        errors = [o[phase] for o in out]
        assert all(e is not None and e[0] == "SyncAbortedError" and e[4] == (world - 1,) for e in errors), errors
        assert all(f"injected at {phase} on rank {world - 1}" in e[1] for e in errors), errors
    assert all(o["unchanged"] for o in out)


# ---- degraded precision: local, at no extra collective ---------------------------------------------------------
DEEPSEEK = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                qk_nope_head_dim=8, v_head_dim=8)
GATE = "model.layers.1.mlp.gate.e_score_correction_bias"


def _deepseek():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(DeepseekV3Config(**DEEPSEEK))


def _degraded(rank, world):
    cast = _deepseek().bfloat16()  # every rank: an engine's cast
    with torch.no_grad():
        cast.get_buffer(GATE).copy_(torch.linspace(-0.3, 0.3, 4))  # a trained bias (bfloat16 rounds it)
    fp32 = _deepseek()
    bn = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).half()
    one = _deepseek()  # bfloat16 on rank 1 only
    with torch.no_grad():
        one.get_buffer(GATE).copy_(torch.linspace(-0.3, 0.3, 4))
    if rank == 1:
        one.bfloat16()
    out = {"cast": logged_call(lambda: zb.buffer_report(cast)), "fp32": zb.buffer_report(fp32),
           "bn": zb.buffer_report(bn), "one": logged_call(lambda: zb.buffer_report(one)),
           "mine": {n: b.clone() for n, b in one.named_buffers()}}
    out["cast_text"] = str(out["cast"]["value"])
    return out


@pytest.mark.stack
def test_buffers_held_below_their_declared_dtype_are_flagged_on_their_rows_and_in_the_advice(ranks2):
    from tests.helpers import HF5

    out = ranks2.run(_degraded, timeout=120)
    cast = out[0]["cast"]["value"]
    assert all(o["cast"]["value"] == cast for o in out)
    # every rank agrees (same values, dtypes, declarations): still one all_gather of three int64
    assert all(o["cast"]["log"] == [("all_gather", "torch.int64", 3)] for o in out), [o["cast"]["log"] for o in out]
    rows = {r.name: r for r in cast.rows}
    assert cast.in_sync and all(r.in_sync for r in cast.rows)
    flagged = {r.name for r in cast.degraded}
    rotary = {"model.rotary_emb.inv_freq"} | ({"model.rotary_emb.original_inv_freq"} if HF5 else set())
    assert flagged == {GATE} | rotary, flagged
    gate = rows[GATE]
    why = "transformers DeepseekV3ForCausalLM._keep_in_fp32_modules_strict" if HF5 else \
        "an aux-loss-free MoE router bias"  # transformers 4.x lists no fp32 buffers for DeepSeek-V3
    assert (gate.dtype, gate.declared, gate.why, gate.degraded_ranks) == ("bfloat16", "float32", why, (0, 1)), gate
    assert all(rows[n].why == "a rotary table" and rows[n].degraded_ranks == (0, 1) for n in rotary)
    advice = cast.advice.splitlines()
    assert 1 <= len(advice) <= 3 and "zb.keep_precision(model)" in advice[-1], advice
    line = next(a for a in advice if f"'{GATE}'" in a)
    assert f"is held in bfloat16 but declared float32 ({why})" in line, line
    assert any("'model.rotary_emb.inv_freq'" in a and "(a rotary table)" in a for a in advice), advice
    text = out[0]["cast_text"]
    assert f"{len(flagged)} held below their declared dtype" in text.splitlines()[0] and len(text.splitlines()) < 40
    assert re.search(rf"\n{re.escape(GATE)} +bfloat16 ", text) and "below float32" in text and cast.advice in text, text
    assert not out[0]["fp32"].degraded and out[0]["fp32"].advice == ""  # fp32: nothing to flag
    bn = out[0]["bn"]
    assert {r.name for r in bn.degraded} == {"1.running_mean", "1.running_var"}
    assert "is held in float16 but declared float32 (BatchNorm statistics)" in bn.advice, bn.advice
    # bfloat16 on rank 1 only: the rows say which ranks hold it degraded, and compare the values in float64
    one = out[0]["one"]["value"]
    assert all(o["one"]["value"] == one for o in out) and out[0]["one"]["error"] is None
    assert len([e for e in out[0]["one"]["log"] if e[0] == "all_gather"]) == 3  # agree, digests, table: no more
    rows = {r.name: r for r in one.rows}
    for name in {GATE} | rotary:
        row = rows[name]
        x = out[0]["mine"][name].double()
        want = float((x.to(torch.bfloat16).double() - x).abs().max())
        assert row.degraded_ranks == (1,) and row.rank_dtypes == ((1, "bfloat16"),) and not row.in_sync, row
        assert want > 0 and row.max_abs_diff == want, (name, row.max_abs_diff, want)
    assert "on rank(s) 1 but declared float32" in one.advice and one.advice.splitlines()[0].startswith("'")


def test_a_report_without_a_process_group_flags_degraded_precision_too():
    model = nn.Sequential(nn.BatchNorm1d(3)).bfloat16()
    report = zb.buffer_report(model)  # the test process has no process group
    assert not report.checked and [r.name for r in report.degraded] == ["0.running_mean", "0.running_var"]
    assert report.degraded[0].degraded_ranks == report.ranks and "keep_precision" in report.advice


def test_the_precision_advice_stays_within_its_lines_and_the_report_under_40():
    kinds = [("bfloat16", "BatchNorm statistics"), ("float16", "BatchNorm statistics"), ("bfloat16", "a rotary table"),
             ("bfloat16", "keep_precision"), ("float16", "a rotary table")]
    rows = tuple(zb.BufferRow(f"layers.{i}.stat", kinds[i % 5][0], (4,), True, False, 0.1 * (i + 1), (1,),
                              0.01 * (i + 1), (), ((1, "float32"),) if i % 7 == 0 else (), (0, 1), "float32",
                              kinds[i % 5][1]) for i in range(45))
    report = zb.BufferReport(rows, (0, 1), 0, 0.0)
    text = str(report)
    lines = text.splitlines()
    precision = [line for line in lines if line.startswith("Precision: ")]
    assert len(lines) < 40 and len(precision) == zb.report.PRECISION_LINES, text
    assert "more buffers of 3 other kinds are held below their declared dtype" in precision[-1], precision
    assert precision[-1].endswith("before anything casts the model.") and "zb.keep_precision(model)" in precision[-1]
    assert math.isclose(report.rows[0].max_abs_diff, 0.1)
