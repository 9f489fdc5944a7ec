"""The real-architecture corpus (tests/corpus.py) through every zero_buffers tool, on 2 and 4 gloo ranks.

For every corpus entry and every tool this shows (a) the bug without the tool (buffers differ across ranks, the
statistics are one rank's, a rank keeps its init values after a rank-0 load), (b) the fix with it (values across
ranks exactly as the tool promises, checked against a reference computed on rank 0 from the corpus' deterministic
builds, or against the source rank's own values), and (c) the model's own API afterwards (`api_checks` all True,
the eval forward equal across ranks where the weights are).

One pool task per (world, tool) loops over the whole corpus (tests.helpers.run_table: a fence after every entry);
ranks return digests and findings, the parent asserts them and names every failing (tool, entry) pair in one
message (tests.helpers.check_table).

Models per rank:
* ``seeded``: ``arch.build(rank)``: weights AND buffers differ per rank (each rank built its own model);
* ``replica``: a data-parallel replica: rank 0's weights and every other buffer, BatchNorm statistics from the
  rank's own data (``seed_bn_stats(build(0), 500 + rank)``); vq_ema, which has no weights, is ``build(rank)``: its
  EMA codebook buffers were trained on each rank's own data;
* ``loaded on rank 0``: ``build(0, stats=(rank == 0))``: rank 0 holds trained statistics, the others the library's
  untrained ones (incident 1 in /work/shared/CONTEXT.md).

ZeRO-3: ``deepspeed.zero.Init`` with ``zero_buffers.Init`` / ``zero_buffers.install()``, then the documented rank-0-only
``load_state_dict`` inside ``GatheredParametersAndBuffers(model, modifier_rank=0)`` and inside DeepSpeed's own
``GatheredParameters(params, modifier_rank=0)`` under install(). Entries whose build raises under zero.Init are
reported by ``test_zero3_entries_that_cannot_be_built_under_zero_init`` as skips with the measured error.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import traceback
import warnings

import pytest
import torch
from torch import nn

import zero_buffers as zb
from tests.helpers import ZERO3_CONFIG, check_table, init_deepspeed, run_table as _run_table

# the tests of what DeepSpeed, transformers and Accelerate do: run on both dependency stacks (.ci/run)
pytestmark = pytest.mark.stack

# Entry names (tests.corpus imports transformers: keep it out of the parent process, which only checks results).
ENTRIES = ("hf_resnet34", "hf_mobilenet_v2", "hf_regnet", "hf_llama", "diffusers_vqmodel", "diffusers_flux2_vae",
           "swa_ema_resnet", "vq_ema", "remote_tiny_vq")
BN_ENTRIES = {"hf_resnet34", "hf_mobilenet_v2", "hf_regnet", "diffusers_flux2_vae", "swa_ema_resnet",
              "remote_tiny_vq"}
NOTHING_TO_SYNC = {"hf_llama", "diffusers_vqmodel"}  # deterministic buffers only (rotary tables) / no buffer at all
TIMEOUT = 400
BATCHES_PER_RANK = 2

# Measured under transformers 5.24 / deepspeed 0.19.8 and 4.57.6 / 0.16: these builds raise inside deepspeed.zero.Init:
# transformers' ResNet/RegNet _init_weights (run by post_init) calls torch.nn.init._calculate_fan_in_and_fan_out on the
# classifier's Linear weight, already partitioned into an empty 1-D tensor (5.24: modeling_resnet.py:276,
# modeling_regnet.py:272). transformers' own ZeRO-3 path (_from_config / from_pretrained under HfDeepSpeedConfig)
# avoids it with no_init_weights + initialize_weights_zero3.
ZERO3_UNBUILDABLE = {"hf_resnet34", "hf_regnet", "swa_ema_resnet"}
ZERO3_UNBUILDABLE_SIGNATURE = "Fan in and fan out can not be computed"


# ============================================================================================ in-rank helpers

def _digest(t: torch.Tensor) -> str:
    """dtype, shape and bytes (NaN == NaN; -0.0 != 0.0)."""
    if t.is_meta:
        return "meta"
    flat = t.detach().cpu().contiguous().reshape(-1)
    h = hashlib.sha1(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(flat.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _bufs(model: nn.Module) -> dict[str, str]:
    return {n: _digest(b) for n, b in model.named_buffers()}


def _params(model: nn.Module) -> dict[str, str]:
    return {n: _digest(p) for n, p in model.named_parameters()}


def _tracking_bn(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats and m.running_mean is not None]


def _stat_names(model: nn.Module) -> list[str]:
    return [f"{n}.{k}" for n, m in _tracking_bn(model) for k in ("running_mean", "running_var", "num_batches_tracked")
            if getattr(m, k, None) is not None]




def _fwd(arch, model: nn.Module) -> str:
    """Digest of the eval-mode forward on the entry's example (cast to the model's dtype)."""
    from tests.corpus import cast_example, eval_no_grad
    dtype = next((t.dtype for t in list(model.parameters()) + list(model.buffers()) if t.is_floating_point()), None)
    with eval_no_grad(model):
        return _digest(arch.forward(model, cast_example(arch.example(2, 0), dtype)))


def _api(arch, model: nn.Module, tmp: str) -> dict[str, str]:
    """The failing api_checks (empty: all True)."""
    from tests.corpus import api_checks
    folder = tempfile.mkdtemp(prefix=f"{arch.name}_", dir=tmp)
    return {k: str(v)[:300] for k, v in api_checks(model, folder, arch).items() if v is not True}


_WARM: set[int] = set()


def _corpus(world: int):
    """The corpus, every build this task uses made once outside any zero.Init in this process: imports (transformers'
    lazy modules, torch._dynamo's polyfills: importing them while zero.Init has patched torch.Tensor.__new__ raises)
    and the remote entry's saved folders are done here."""
    from tests.corpus import CORPUS
    if world not in _WARM:
        import torch._dynamo  # noqa: F401
        for arch in CORPUS:
            arch.build(0)
        for seed in (*range(world), 99):  # the remote entry saves its folder on first build: not under zero.Init
            next(a for a in CORPUS if a.name == "remote_tiny_vq").build(seed)
        _WARM.add(world)
    assert tuple(a.name for a in CORPUS) == ENTRIES, "tests/corpus.py changed: update ENTRIES / BN_ENTRIES here"
    return CORPUS


def _replica(arch, rank: int) -> nn.Module:
    """A data-parallel replica: rank 0's weights and buffers, BatchNorm statistics from this rank's own data
    (vq_ema: its EMA codebook buffers trained on this rank's data; it has no weights)."""
    from tests.corpus import seed_bn_stats
    if arch.name == "vq_ema":
        return arch.build(rank)
    model = arch.build(0)
    return seed_bn_stats(model, 500 + rank) if arch.has_bn else model


def _flux2_bn_forward(vae: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What the Flux2 latent BatchNorm normalises (pipeline_flux2.py): patchified latents. The VAE's own forward never
    calls `vae.bn`, so recompute_bn_stats needs this as `forward=`."""
    latents = vae.encode(x).latent_dist.mode()
    b, c, h, w = latents.shape
    latents = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)
    return vae.bn(latents)


def _recompute_forward(arch):
    return _flux2_bn_forward if arch.name == "diffusers_flux2_vae" else None


def _shard(arch, rank: int) -> list:
    """This rank's synthetic batches (batch 4, different on every rank)."""
    return [arch.example(4, 1000 + 10 * rank + i) for i in range(BATCHES_PER_RANK)]


def _feed(model: nn.Module, batch, forward) -> None:
    """One batch through the model as recompute_bn_stats feeds it."""
    if forward is not None:
        forward(model, batch)
    elif isinstance(batch, dict):
        model(**batch)
    else:
        model(batch)


def _close(a: torch.Tensor, ref: torch.Tensor, what: str) -> bool | str:
    """Float32 result vs float64 reference: within a few float32 ulps."""
    a = a.detach().double()
    err = (a - ref).abs().max().item() if a.numel() else 0.0
    tol = 4e-7 * max(1.0, ref.abs().max().item())
    return True if err <= tol else f"{what}: max |diff| {err:.3g} > {tol:.3g}"


def _mixture_check(arch, world: int, model: nn.Module) -> bool | str:
    """model's BatchNorm statistics == the float64 mixture of the replicas of ranks 0..world-1, weights
    num_batches_tracked (computed here from the corpus' deterministic builds, no collective)."""
    reps = [dict(_replica(arch, r).named_modules()) for r in range(world)]
    for name, bn in _tracking_bn(model):
        layers = [rep[name] for rep in reps]
        n = torch.tensor([float(m.num_batches_tracked) for m in layers], dtype=torch.float64)
        w = (n / n.sum())[:, None]
        means = torch.stack([m.running_mean.double() for m in layers])
        vars_ = torch.stack([m.running_var.double() for m in layers])
        mean = (w * means).sum(0)
        var = (w * vars_).sum(0) + (w * (means - mean) ** 2).sum(0)
        for got, ref, what in ((bn.running_mean, mean, "running_mean"), (bn.running_var, var, "running_var")):
            ok = _close(got, ref, f"{name}.{what}")
            if ok is not True:
                return ok
        if int(bn.num_batches_tracked) != int(n.sum()):
            return f"{name}.num_batches_tracked = {int(bn.num_batches_tracked)}, expected the sum {int(n.sum())}"
    return True


def _first_bn_check(arch, world: int, model: nn.Module) -> bool | str:
    """model's statistics at the FIRST BatchNorm the forward reaches == the population statistics (mean, unbiased
    var) of that layer's inputs over all ranks' batches, from a single-process reference run here."""
    ref = _replica(arch, 0)  # every replica has the same weights: the first BatchNorm's inputs do not depend on rank
    calls: list[tuple[str, torch.Tensor]] = []
    hooks = [m.register_forward_pre_hook(lambda mod, args, n=n: calls.append((n, args[0].detach().double())))
             for n, m in _tracking_bn(ref)]
    forward = _recompute_forward(arch)
    try:
        ref.train()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            for r in range(world):
                for batch in _shard(arch, r):
                    _feed(ref, batch, forward)
    finally:
        for h in hooks:
            h.remove()
    if not calls:
        return "the reference forward reached no BatchNorm"
    first = calls[0][0]
    x = torch.cat([t for n, t in calls if n == first])
    dims = [0, *range(2, x.dim())]
    mean, var = x.mean(dims), x.var(dims, correction=1)
    bn = dict(model.named_modules())[first]
    for got, want, what in ((bn.running_mean, mean, "running_mean"), (bn.running_var, var, "running_var")):
        ok = _close(got, want, f"{first}.{what}")
        if ok is not True:
            return ok
    calls_here = sum(1 for n, _ in calls if n == first)
    if int(bn.num_batches_tracked) != max(1, round(calls_here / world)):
        return f"{first}.num_batches_tracked = {int(bn.num_batches_tracked)}, expected {round(calls_here / world)}"
    return True


def _try(fn) -> object:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the parent reports it
        return f"{type(e).__name__}: {e} :: {traceback.format_exc()[-600:]}"


def _row(r) -> tuple:
    return (r.name, r.dtype, r.shape, r.persistent, r.in_sync, r.max_abs_diff, r.differing_ranks, r.max_rel_diff,
            r.untrained_ranks)


def _assert_outcome(call) -> dict:
    """assert_buffers_in_sync / sync_buffers(check): the error (type, message, report rows) or the return value."""
    try:
        value = call()
    except zb.BuffersOutOfSyncError as e:
        return {"raised": type(e).__name__, "message": str(e),
                "rows": [_row(r) for r in e.report.rows] if e.report is not None else None}
    except Exception as e:  # noqa: BLE001
        return {"raised": type(e).__name__, "message": f"{e}\n{traceback.format_exc()[-800:]}", "rows": None}
    return {"raised": None, "value": value if isinstance(value, int) else len(value.rows)}


# ============================================================================================ parent helpers

class Results:
    """Per-rank results of one case, with assertions that name what failed."""

    def __init__(self, name: str, per_rank: list[dict]):
        self.name, self.r, self.world = name, per_rank, len(per_rank)

    def differing(self, key: str) -> set[str]:
        """Names whose digest under ``key`` is not the same on every rank."""
        first = self.r[0][key]
        assert all(set(x[key]) == set(first) for x in self.r), f"{key}: ranks have different names"
        return {n for n in first if any(x[key][n] != first[n] for x in self.r)}

    def equal_to(self, key: str, ref: dict[str, str], what: str, names=None) -> None:
        for rank, x in enumerate(self.r):
            names_here = ref.keys() if names is None else names
            bad = [n for n in names_here if x[key].get(n) != ref.get(n)]
            assert not bad, f"rank {rank}: {len(bad)} of {len(list(names_here))} {what} differ, e.g. {bad[:3]}"

    def same(self, key: str, what: str) -> None:
        vals = [x[key] for x in self.r]
        assert all(v == vals[0] for v in vals), f"{what} differ across ranks: {vals}"

    def all_true(self, key: str) -> None:
        for rank, x in enumerate(self.r):
            assert x[key] is True, f"rank {rank}: {key}: {x[key]}"

    def api_ok(self, key: str = "api") -> None:
        for rank, x in enumerate(self.r):
            assert not x[key], f"rank {rank}: api_checks failed: {x[key]}"


def _check_cases(names, out, check) -> None:
    check_table(names, out, lambda name, per_rank: check(Results(name, per_rank)))


def _entry(case: str) -> str:
    return case.split(":", 1)[1]


# ============================================================================================ 1. broadcast_buffers

def _broadcast_body(rank, world, tmp):
    from tests.corpus import by_name
    _corpus(world)
    src = world - 1  # not rank 0: the group-relative source is honoured

    def case(name):
        arch = by_name(_entry(name))
        model = arch.build(rank)
        r = {"before": _bufs(model), "pbefore": _params(model), "fwd_ref": _fwd(arch, arch.build(0))}
        r["n"] = zb.broadcast_buffers(model, src=src)
        r.update(after=_bufs(model), pafter=_params(model))
        both = arch.build(rank)
        r["n_both"] = zb.broadcast_buffers(both, include_parameters=True)
        r.update(after_both=_bufs(both), pafter_both=_params(both), fwd_both=_fwd(arch, both),
                 api_both=_api(arch, both, tmp))
        return r

    names = [f"broadcast:{e}" for e in ENTRIES]
    return run_table(world, names, case), names


def _check_broadcast(res: Results) -> None:
    entry, w = _entry(res.name), res.world
    src = w - 1
    differ = res.differing("before")
    if entry in NOTHING_TO_SYNC:
        assert not differ, f"expected no divergence for {entry}, got {sorted(differ)[:3]}"
    else:  # (a) each rank built its own model: seeded buffers differ
        assert differ, "no buffer differed across the rank-seeded builds: the bug is not shown"
    nbuf, npar = len(res.r[0]["before"]), len(res.r[0]["pbefore"])
    assert all(x["n"] == nbuf for x in res.r), f"returned {[x['n'] for x in res.r]}, expected {nbuf} buffers"
    res.equal_to("after", res.r[src]["before"], f"buffers (vs rank {src}'s)")  # (b) bitwise the source's
    for rank, x in enumerate(res.r):  # parameters untouched without include_parameters
        assert x["pafter"] == x["pbefore"], f"rank {rank}: broadcast_buffers changed parameters"
    assert all(x["n_both"] == nbuf + npar for x in res.r), f"include_parameters returned {[x['n_both'] for x in res.r]}"
    res.equal_to("after_both", res.r[0]["before"], "buffers (include_parameters, vs rank 0's)")
    res.equal_to("pafter_both", res.r[0]["pbefore"], "parameters (include_parameters, vs rank 0's)")
    for rank, x in enumerate(res.r):  # (c) forward equal across ranks and to rank 0's own model
        assert x["fwd_both"] == res.r[0]["fwd_ref"], f"rank {rank}: forward differs from rank 0's model"
    res.api_ok("api_both")


def test_broadcast_buffers_every_entry(ranks, tmp_path):
    """Rank-seeded builds differ; after broadcast_buffers(src=world-1) every buffer is bitwise the source's (params
    untouched); with include_parameters=True buffers and params are rank 0's and forwards equal rank 0's model."""
    out, names = _run(ranks, _broadcast_body, str(tmp_path))
    _check_cases(names, out, _check_broadcast)


# ============================================================================================ 2. buffer_report / assert

def _report_body(rank, world, tmp):
    from tests.corpus import by_name
    _corpus(world)

    def case(name):
        situation, entry = name.split(":")
        arch = by_name(entry)
        if situation == "trained":
            model = _replica(arch, rank)
            model.train()
        else:  # loaded on rank 0 only, frozen (eval)
            model = arch.build(0, stats=(rank == 0))
            model.eval()
        before = _bufs(model)
        report = zb.buffer_report(model)
        r = {"before": before, "rows": [_row(row) for row in report.rows], "training": report.training,
             "ranks": report.ranks, "reference": report.reference_rank, "cls": type(model).__name__,
             "stats": _stat_names(model)}
        r["assert"] = _assert_outcome(lambda: zb.assert_buffers_in_sync(model))
        r["after"] = _bufs(model)
        return r

    names = [f"{s}:{e}" for s in ("trained", "loaded0") for e in ENTRIES]
    return run_table(world, names, case), names


TITLES = ("buffer", "dtype", "shape", "in sync", "max |diff|", "rel", "differing ranks")
RIGHT = {4, 5}


def _columns_line_up(message: str, rows: list[tuple]) -> None:
    """The out-of-sync table in the message: every cell starts (left-aligned) or ends (right-aligned) where its
    title does, whatever the length of the names; no name is cut. Up to ``report.SHORT_ROWS`` differing buffers
    every one is listed in model order; past that the ``report.WORST_ROWS`` worst, worst first, then the modules."""
    lines = message.split("\n")
    header = next(i for i, line in enumerate(lines) if line.startswith("buffer "))
    titles = lines[header]
    starts, pos = [], 0
    for t in TITLES:
        pos = titles.index(t, pos)
        starts.append(pos)
        pos += len(t)
    bad = [r for r in rows if not r[4]]
    worst_first = sorted(bad, key=lambda r: (-r[7], -r[5]))
    shown = bad if len(bad) <= zb.report.SHORT_ROWS else worst_first[:zb.report.WORST_ROWS]
    for k, r in enumerate(shown):
        line = lines[header + 1 + k]
        cells = (r[0], r[1], str(list(r[2])), "NO", f"{r[5]:.4g}", f"{r[7]:.3g}", ", ".join(map(str, r[6])) or "-")
        for i, (cell, start) in enumerate(zip(cells, starts)):
            if i in RIGHT:
                end = start + len(TITLES[i])
                begin = end - len(cell)
                assert line[begin:end] == cell and (begin == 0 or line[begin - 1] == " "), \
                    f"row {k} column {TITLES[i]!r}: {cell!r} does not end at {end}:\n{titles}\n{line}"
            else:
                assert line[start:start + len(cell)] == cell and (start == 0 or line[start - 1] == " "), \
                    f"row {k} column {TITLES[i]!r}: {cell!r} not at {start}:\n{titles}\n{line}"
        assert len(r[0]) <= starts[1] - 2, f"name {r[0]!r} longer than its column"
    if len(bad) > zb.report.SHORT_ROWS:  # the rest summed up by module, and counted
        assert lines[header + 1 + len(shown)].startswith("module "), lines[header + 1 + len(shown)]
        assert f"the {len(shown)} worst of {len(bad)} differing buffers listed, {len(bad) - len(shown)} more" in message


def _check_report(res: Results) -> None:
    situation, entry = res.name.split(":")
    w = res.world
    x0 = res.r[0]
    differ = res.differing("before")
    for rank, x in enumerate(res.r):
        assert x["after"] == x["before"], f"rank {rank}: the report changed buffers"
    res.same("rows", "report rows")
    res.same("assert", "assert_buffers_in_sync outcomes")  # the same error, message and rows on every rank
    rows = {row[0]: row for row in x0["rows"]}
    assert set(rows) == set(x0["before"]), "the report does not list every buffer"
    flagged = {n for n, row in rows.items() if not row[4]}
    assert flagged == differ, f"flagged {sorted(flagged ^ differ)[:5]} wrongly (flagged vs differing)"
    if entry in NOTHING_TO_SYNC:
        assert not differ
    else:
        assert differ, "nothing differed: the bug is not shown"
    for n, row in rows.items():
        expected_ranks = tuple(r for r in range(w) if res.r[r]["before"][n] != x0["before"][n])
        assert row[6] == expected_ranks, f"{n}: differing_ranks {row[6]}, expected {expected_ranks}"
        assert (row[5] > 0) == (n in differ), f"{n}: max_abs_diff {row[5]}"
        fresh = tuple(range(1, w)) if situation == "loaded0" and n in differ and n in x0["stats"] else ()
        assert row[8] == fresh, f"{n}: untrained_ranks {row[8]}, expected {fresh}"
    assert x0["training"] == (situation == "trained") and x0["ranks"] == tuple(range(w)) and x0["reference"] == 0
    outcome = x0["assert"]
    if not differ:
        assert outcome["raised"] is None and outcome["value"] == len(rows), outcome
        return
    assert outcome["raised"] == "BuffersOutOfSyncError", outcome
    msg = outcome["message"]
    assert outcome["rows"] == x0["rows"], "the error's report is not the report"
    assert msg.startswith(f"{x0['cls']}: buffers out of sync across ranks.\n"), msg[:200]
    assert f"{len(differ)} of {len(rows)} buffers differ across ranks {list(range(w))}" in msg
    _columns_line_up(msg, x0["rows"])
    fix = msg.rsplit("\n", 1)[-1]
    assert fix.startswith("Fix: "), fix
    stats_differ = bool(differ & set(x0["stats"]))
    if situation == "loaded0" and stats_differ:
        assert f"rank(s) {list(range(1, w))} are still at their initial values" in fix, fix
        assert "broadcast_buffers(module, src=0)" in fix and "merging statistics would be wrong" in fix, fix
    elif stats_differ:  # trained per rank, train mode
        assert "updated on each rank's own data" in fix and "average_bn_stats" in fix and "recompute_bn_stats" in fix, \
            fix
    elif situation == "loaded0" and "looks uninitialised on rank" in fix:
        # vq_ema loaded on rank 0 only: the other ranks' codebook counters are still the zeros they were made with,
        # never written, which [Note: uninitialised buffers] cannot tell from leftover all-zero memory (its
        # documented miss; it depends on whether the stack's zero.Init wrote them). Either advice names the cure.
        assert "_codebook.cluster_size" in fix and "zero_buffers.broadcast_buffers(module)" in fix, fix
    else:  # vq_ema: EMA codebooks, no BatchNorm
        assert fix.startswith("Fix: Take one rank's values with zero_buffers.broadcast_buffers(module)"), fix


def test_buffer_report_and_assert_every_entry(ranks, tmp_path):
    """The report flags exactly the differing buffers (differing and untrained ranks right), identically everywhere;
    assert_buffers_in_sync raises the same BuffersOutOfSyncError on every rank, its table's columns line up for the
    long real names, and its advice fits: merge/recompute for per-rank training, broadcast for a rank-0 load."""
    out, names = _run(ranks, _report_body, str(tmp_path))
    _check_cases(names, out, _check_report)


# ============================================================================================ 3. average_bn_stats

def _average_body(rank, world, tmp):
    from tests.corpus import by_name
    _corpus(world)

    def case(name):
        arch = by_name(_entry(name))
        model = _replica(arch, rank)
        r = {"before": _bufs(model), "pbefore": _params(model), "fwd_before": _fwd(arch, model),
             "stats": _stat_names(model), "n_bn": len(_tracking_bn(model))}
        r["n"] = zb.average_bn_stats(model)
        r.update(after=_bufs(model), pafter=_params(model), fwd_after=_fwd(arch, model), api=_api(arch, model, tmp))
        if rank == 0:
            r["reference"] = _try(lambda: _mixture_check(arch, world, model))
        return r

    names = [f"average:{e}" for e in ENTRIES]
    return run_table(world, names, case), names


def _check_average(res: Results) -> None:
    entry = _entry(res.name)
    x0 = res.r[0]
    stats = set(x0["stats"])
    differ = res.differing("before")
    others = set(x0["before"]) - stats
    for rank, x in enumerate(res.r):  # nothing but the statistics is touched
        assert x["pafter"] == x["pbefore"], f"rank {rank}: parameters changed"
        assert {n: x["after"][n] for n in others} == {n: x["before"][n] for n in others}, \
            f"rank {rank}: a buffer other than BatchNorm statistics changed"
    if entry not in BN_ENTRIES:
        assert all(x["n"] == 0 for x in res.r), f"returned {[x['n'] for x in res.r]} without BatchNorm"
        for rank, x in enumerate(res.r):
            assert x["after"] == x["before"], f"rank {rank}: changed a model without BatchNorm"
        res.api_ok()
        return
    assert differ == stats, f"(a) expected exactly the statistics to differ, got {sorted(differ ^ stats)[:4]}"
    assert len({x["fwd_before"] for x in res.r}) == res.world, "(a) forwards did not differ before the merge"
    assert all(x["n"] == x0["n_bn"] for x in res.r), f"returned {[x['n'] for x in res.r]}, {x0['n_bn']} BN layers"
    assert not res.differing("after"), f"buffers still differ: {sorted(res.differing('after'))[:3]}"
    assert x0["reference"] is True, x0["reference"]
    res.same("fwd_after", "forwards after the merge")
    res.api_ok()


def test_average_bn_stats_every_entry(ranks, tmp_path):
    """BatchNorm entries: the statistics become the float64 mixture of the ranks' (weights num_batches_tracked) on
    every rank, forwards agree; entries without BatchNorm: 0 everywhere; nothing else is touched."""
    out, names = _run(ranks, _average_body, str(tmp_path))
    _check_cases(names, out, _check_average)


# ============================================================================================ 4. recompute_bn_stats

def _recompute_body(rank, world, tmp):
    from tests.corpus import by_name
    _corpus(world)

    def case(name):
        arch = by_name(_entry(name))
        model = _replica(arch, rank)
        model.eval()
        r = {"before": _bufs(model), "pbefore": _params(model), "stats": _stat_names(model),
             "n_bn": len(_tracking_bn(model))}
        r["n"] = zb.recompute_bn_stats(model, _shard(arch, rank), forward=_recompute_forward(arch), progress=False)
        r["modes"] = not any(m.training for m in model.modules())
        r.update(after=_bufs(model), pafter=_params(model), fwd_after=_fwd(arch, model), api=_api(arch, model, tmp))
        if rank == 0 and arch.has_bn:
            r["reference"] = _try(lambda: _first_bn_check(arch, world, model))
        return r

    names = [f"recompute:{e}" for e in ENTRIES]
    return run_table(world, names, case), names


def _check_recompute(res: Results) -> None:
    entry = _entry(res.name)
    x0 = res.r[0]
    stats = set(x0["stats"])
    others = set(x0["before"]) - stats
    for rank, x in enumerate(res.r):
        assert x["modes"] is True, f"rank {rank}: eval mode not restored"
        assert x["pafter"] == x["pbefore"], f"rank {rank}: parameters changed"
        assert {n: x["after"][n] for n in others} == {n: x["before"][n] for n in others}, \
            f"rank {rank}: a buffer other than BatchNorm statistics changed"
    if entry not in BN_ENTRIES:
        assert all(x["n"] == 0 for x in res.r), f"returned {[x['n'] for x in res.r]} without BatchNorm"
        res.api_ok()
        return
    assert res.differing("before") == stats, "(a) the replicas' statistics were not rank-local"
    assert all(x["n"] == x0["n_bn"] for x in res.r), f"returned {[x['n'] for x in res.r]}, {x0['n_bn']} BN layers"
    assert not res.differing("after"), f"buffers differ after: {sorted(res.differing('after'))[:3]}"
    for rank, x in enumerate(res.r):
        assert x["after"] != x["before"], f"rank {rank}: nothing was recomputed"
    assert x0["reference"] is True, x0["reference"]
    res.same("fwd_after", "forwards after recompute")
    res.api_ok()


def test_recompute_bn_stats_every_entry(ranks, tmp_path):
    """From rank-sharded synthetic batches in train mode: the first BatchNorm's statistics equal the population
    statistics of a single-process run over all ranks' batches, every buffer is equal across ranks, modes, weights
    and non-BN buffers are restored."""
    out, names = _run(ranks, _recompute_body, str(tmp_path))
    _check_cases(names, out, _check_recompute)


# ============================================================================================ 5. sync_buffers

POLICIES = ("broadcast", "average", "recompute", "check")


def _sync_body(rank, world, tmp):
    from tests.corpus import by_name
    _corpus(world)

    def case(name):
        policy, entry = name.split(":")
        arch = by_name(entry)
        model = arch.build(rank) if policy == "broadcast" else _replica(arch, rank)
        r = {"before": _bufs(model), "pbefore": _params(model), "stats": _stat_names(model)}
        if policy == "check":
            r["check"] = _assert_outcome(lambda: zb.sync_buffers(model, "check"))
            r["after"] = _bufs(model)
            zb.broadcast_buffers(model)
            r["check_synced"] = _assert_outcome(lambda: zb.sync_buffers(model, "check"))
            return r
        kwargs = {"data": _shard(arch, rank), "forward": _recompute_forward(arch)} if policy == "recompute" else {}
        r["n"] = zb.sync_buffers(model, policy, src=world - 1 if policy == "broadcast" else 0, **kwargs)
        r.update(after=_bufs(model), pafter=_params(model), fwd_after=_fwd(arch, model),
                 api=_api(arch, model, tmp) if policy == "recompute" else {})
        if rank == 0 and arch.has_bn and policy == "average":
            r["reference"] = _try(lambda: _mixture_check(arch, world, model))
        if rank == 0 and arch.has_bn and policy == "recompute":
            r["reference"] = _try(lambda: _first_bn_check(arch, world, model))
        return r

    names = [f"{p}:{e}" for p in POLICIES for e in ENTRIES]
    return run_table(world, names, case), names


def _check_sync(res: Results) -> None:
    policy, entry = res.name.split(":")
    x0, w = res.r[0], res.world
    nbuf = len(x0["before"])
    differ = res.differing("before")
    if entry not in NOTHING_TO_SYNC:
        assert differ, "(a) nothing differed before the sync"
    if policy == "check":
        res.same("check", "check outcomes")
        for rank, x in enumerate(res.r):
            assert x["after"] == x["before"], f"rank {rank}: policy 'check' changed buffers"
        if differ:
            assert x0["check"]["raised"] == "BuffersOutOfSyncError", x0["check"]
            assert {row[0] for row in x0["check"]["rows"] if not row[4]} == differ
        else:
            assert x0["check"] == {"raised": None, "value": nbuf}, x0["check"]
        assert all(x["check_synced"] == {"raised": None, "value": nbuf} for x in res.r), x0["check_synced"]
        return
    assert all(x["n"] == nbuf for x in res.r), f"returned {[x['n'] for x in res.r]}, expected {nbuf}"
    assert not res.differing("after"), f"buffers differ after: {sorted(res.differing('after'))[:3]}"
    for rank, x in enumerate(res.r):
        assert x["pafter"] == x["pbefore"], f"rank {rank}: parameters changed"
    src = w - 1 if policy == "broadcast" else 0
    stats = set(x0["stats"])
    if policy == "broadcast":
        res.equal_to("after", res.r[src]["before"], f"buffers (vs rank {src}'s)")
    else:  # merged / recomputed statistics; every other buffer is rank 0's
        res.equal_to("after", res.r[0]["before"], "non-BN buffers (vs rank 0's)",
                     names=sorted(set(x0["before"]) - stats))
        if entry in BN_ENTRIES:
            assert x0["reference"] is True, x0["reference"]
    if policy != "broadcast":  # replicas: equal weights, now equal buffers
        res.same("fwd_after", "forwards after the sync")
    res.api_ok()


def test_sync_buffers_every_policy_every_entry(ranks, tmp_path):
    """sync_buffers broadcast (src=world-1) / average (mixture, then rank 0's) / recompute (population stats, then rank
    0's) / check (the same BuffersOutOfSyncError everywhere, nothing changed; passes once in sync)."""
    out, names = _run(ranks, _sync_body, str(tmp_path))
    _check_cases(names, out, _check_sync)


# ============================================================================================ 6. ZeRO-3

def _zero3_body(rank, world, tmp, variant):
    from tests.corpus import by_name
    from tests.hf_tiny import zero3_switched_on
    deepspeed = init_deepspeed()
    _corpus(world)
    assert not zb.installed(), "an earlier task left zero_buffers.install() active in this worker"

    def build(arch, init):
        """arch.build(rank) under `init`; the trust_remote_code entry loads through from_pretrained, which builds
        under zero.Init only when transformers is told ZeRO-3 is on (HfDeepSpeedConfig)."""
        hf = zero3_switched_on("hf_config", ZERO3_CONFIG) if arch.name == "remote_tiny_vq" else contextlib.nullcontext()
        with hf, init:
            return arch.build(rank)

    def zero(model):
        return [p for p in model.parameters() if hasattr(p, "ds_id")]

    def observe(arch, model, tmp_api: bool, gather: bool = True):
        """Full parameters, buffers, forward (and the failing api_checks) inside DeepSpeed's read-only gather; buffers
        only (ZeRO-3 never partitions them) without ``gather``."""
        if not gather:
            return {"bufs": _bufs(model)}
        with deepspeed.zero.GatheredParameters(zero(model)):
            out = {"params": _params(model), "bufs": _bufs(model), "fwd": _fwd(arch, model)}
            if tmp_api:
                out["api"] = _api(arch, model, tmp)
        return out

    def load(model, ckpt, how):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ctx = (zb.GatheredParametersAndBuffers(model, modifier_rank=0) if how == "ours"
                   else deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0))
            with ctx:
                if rank == 0:
                    model.load_state_dict(ckpt)
        return [str(w.message)[:200] for w in caught if issubclass(w.category, RuntimeWarning)
                and "zero_buffers" in str(w.message)]

    def case(name):
        arch = by_name(_entry(name))
        ckpt_model = arch.build(99)  # the "pretrained" checkpoint (deterministic: the same on every rank)
        ckpt = {k: v.clone() for k, v in ckpt_model.state_dict().items()}
        r = {"ckpt": {k: _digest(v) for k, v in ckpt.items()}, "ckpt_fwd": _fwd(arch, ckpt_model),
             "persistent": sorted(set(ckpt) & set(dict(ckpt_model.named_buffers())))}
        # ---- without the tools: deepspeed.zero.Init, DeepSpeed's GatheredParameters(modifier_rank=0)
        try:
            plain = build(arch, deepspeed.zero.Init(config_dict_or_path=ZERO3_CONFIG))
        except Exception as e:  # noqa: BLE001 - the parent turns this into a skip with the reason
            tb = traceback.extract_tb(e.__traceback__)
            where = next((f"{os.path.relpath(f.filename, os.path.dirname(torch.__file__) + '/..')}:{f.lineno} "
                          f"{f.name}: {f.line}" for f in reversed(tb) if "transformers" in f.filename), "")
            return {"unbuildable": f"{type(e).__name__}: {e} (at {where})"}
        r["zero_params"] = len(zero(plain))
        r["plain_build"] = observe(arch, plain, False)  # parameters: DeepSpeed broadcast them at zero.Init
        r["plain_warn"] = load(plain, ckpt, "deepspeed")
        r["plain_load"] = observe(arch, plain, False)
        # ---- with the tools
        if variant == "zb_init":
            model = build(arch, zb.Init(config_dict_or_path=ZERO3_CONFIG))
            r["build"] = observe(arch, model, False, gather=False)
            r["warn"] = load(model, ckpt, "ours")
            r["load"] = observe(arch, model, True)
            return r
        zb.install()
        try:
            model = build(arch, deepspeed.zero.Init(config_dict_or_path=ZERO3_CONFIG))
            r["build"] = observe(arch, model, False, gather=False)
            r["warn"] = load(model, ckpt, "deepspeed")  # DeepSpeed's own class, patched by install()
            r["load"] = observe(arch, model, True)
        finally:
            zb.uninstall()
        return r

    names = [f"zero3_{variant}:{e}" for e in ENTRIES]
    return run_table(world, names, case), names


# install() + DeepSpeed's GatheredParameters(list(model.parameters()), modifier_rank=0) on a model WITHOUT parameters
# (vector-quantize's EMA VectorQuantize): the list is empty, DeepSpeed's context is a no-op, install() cannot tell which
# module the body touches, and it stays silent (it warns only for lists of non-ZeRO tensors: DeepSpeed's own 16-bit
# export passes an empty list for every parameter-free module). The rank-0 load stays on rank 0; pinned below.
# GatheredParametersAndBuffers(model, modifier_rank=0) (given the module) covers it.
NO_PARAMETERS = {"vq_ema"}


# (function, entry, step) -> the buffers ranks > 0 are known to miss; empty: none left.
KNOWN_BUGS: dict[tuple[str, str, str], list[str]] = {}


def _expected_after_load(res: Results) -> dict[str, str]:
    """Persistent buffers: the checkpoint's; non-persistent ones: rank 0's values after the build."""
    x0 = res.r[0]
    ckpt = x0["ckpt"]
    return {n: ckpt[n] if n in ckpt else x0["build"]["bufs"][n] for n in x0["build"]["bufs"]}


def _check_zero3(res: Results, variant: str) -> None:
    entry = _entry(res.name)
    x0 = res.r[0]
    if "unbuildable" in x0:
        assert entry in ZERO3_UNBUILDABLE and ZERO3_UNBUILDABLE_SIGNATURE in x0["unbuildable"], x0["unbuildable"]
        return
    assert entry not in ZERO3_UNBUILDABLE, f"{entry} now builds under zero.Init: update ZERO3_UNBUILDABLE"
    ckpt = x0["ckpt"]
    ckpt_params = {n: d for n, d in ckpt.items() if n not in x0["plain_build"]["bufs"]}
    persistent = x0["persistent"]
    # (a) without the tools
    plain = Results(res.name, [x["plain_build"] for x in res.r])
    assert not plain.differing("params"), "DeepSpeed did not broadcast the parameters at zero.Init"
    build_differ = plain.differing("bufs")
    if entry in BN_ENTRIES - {"remote_tiny_vq"} or entry == "vq_ema":
        assert build_differ, "(a) the rank-seeded buffers did not differ after deepspeed.zero.Init"
    loaded = Results(res.name, [x["plain_load"] for x in res.r])
    loaded.equal_to("params", ckpt_params, "parameters after DeepSpeed's rank-0 load")
    for rank, x in enumerate(res.r):
        if rank == 0:
            assert all(x["plain_load"]["bufs"][n] == ckpt[n] for n in persistent), "rank 0 did not load the checkpoint"
            continue
        kept = [n for n in persistent if x["plain_load"]["bufs"][n] == x["plain_build"]["bufs"][n] != ckpt[n]]
        assert all(x["plain_load"]["bufs"][n] == x["plain_build"]["bufs"][n] for n in x["plain_build"]["bufs"]), \
            f"rank {rank}: DeepSpeed's GatheredParameters changed buffers"
        if persistent:
            assert kept, f"(a) rank {rank}: no buffer kept its init value: the bug is not shown"
        if entry in BN_ENTRIES or entry == "vq_ema":
            assert x["plain_load"]["fwd"] != x0["ckpt_fwd"], f"(a) rank {rank}: forward already equals the checkpoint's"
    # (b) with the tool: zero.Init exit sync, then the rank-0 load reaches every rank
    tool = Results(res.name, [x["build"] for x in res.r])
    tool.equal_to("bufs", x0["build"]["bufs"], "buffers after the build (vs rank 0's)")
    expected = _expected_after_load(res)
    for key in ("load",):
        after = Results(res.name, [x[key] for x in res.r])
        warned = [x["warn"] for x in res.r]
        if key == "load" and variant == "install" and entry in NO_PARAMETERS:  # documented limitation, see above
            assert x0[key]["bufs"] == expected, "rank 0 did not load the checkpoint"
            assert all(x[key]["bufs"] == x["build"]["bufs"] for x in res.r[1:]), "install() changed a no-op context"
            continue
        if (variant, entry, key) in KNOWN_BUGS:  # pinned: fails once fixed (then drop it from KNOWN_BUGS)
            missed = sorted(n for n in expected if any(x[key]["bufs"][n] != expected[n] for x in res.r[1:]))
            assert missed == KNOWN_BUGS[(variant, entry, key)], f"known bug changed: ranks > 0 miss {missed}"
            continue
        assert warned == [[]] * res.world, f"{key}: warnings {warned}"
        after.equal_to("params", ckpt_params, f"parameters ({key})")
        after.equal_to("bufs", expected, f"buffers ({key}, vs the checkpoint's)")
        for rank, x in enumerate(res.r):  # (c) forward equals the checkpoint model's on every rank
            assert x[key]["fwd"] == x0["ckpt_fwd"], f"rank {rank}: forward ({key}) differs from the checkpoint model's"
            # api_checks inside DeepSpeed's gather: only pickle / torch.save fail, for any ZeRO-3 model: DeepSpeed's
            # parameters carry their ProcessGroup (not picklable), whatever zero_buffers did
            assert set(x[key]["api"]) <= {"pickle", "torch_save"} and all(
                "ProcessGroup" in v for v in x[key]["api"].values()), f"rank {rank}: api_checks {x[key]['api']}"
            assert bool(x[key]["api"]) == (x0["zero_params"] > 0), f"rank {rank}: api_checks {x[key]['api']}"


@pytest.mark.parametrize("variant", ["zb_init", "install"])
def test_zero3_build_and_rank0_load_every_entry(ranks, tmp_path, variant):
    """deepspeed.zero.Init leaves rank-seeded buffers apart and a rank-0 load under DeepSpeed's GatheredParameters
    leaves other ranks at their init values; zero_buffers.Init / install() sync at the build, and the rank-0 load
    inside GatheredParametersAndBuffers (and DeepSpeed's own class under install()) reaches every rank: parameters
    and buffers are the checkpoint's, forwards equal the checkpoint model's."""
    out, names = _run(ranks, _zero3_body, str(tmp_path), variant)
    _ZERO3_SEEN.update({_entry(n): out[0][n]["unbuildable"] for n in names
                        if isinstance(out[0].get(n), dict) and "unbuildable" in out[0][n]})
    _check_cases(names, out, lambda res: _check_zero3(res, variant))


_ZERO3_SEEN: dict[str, str] = {}  # entry -> the error its build raised under zero.Init (filled by the tests above)


def _probe_zero3_build(rank, world):
    from tests.corpus import by_name
    deepspeed = init_deepspeed()
    _corpus(world)
    out = {}
    for name in sorted(ZERO3_UNBUILDABLE):
        try:
            with deepspeed.zero.Init(config_dict_or_path=ZERO3_CONFIG):
                by_name(name).build(rank)
            out[name] = None
        except Exception as e:  # noqa: BLE001
            out[name] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.parametrize("entry", sorted(ZERO3_UNBUILDABLE))
def test_zero3_entries_that_cannot_be_built_under_zero_init(ranks2, entry):
    """Skipped, with the measured error: these corpus builds raise inside deepspeed.zero.Init."""
    if entry not in _ZERO3_SEEN:
        _ZERO3_SEEN.update({k: v for k, v in ranks2.run(_probe_zero3_build, timeout=120)[0].items() if v})
    reason = _ZERO3_SEEN.get(entry)
    assert reason is not None, f"{entry} now builds under deepspeed.zero.Init: cover it in the ZeRO-3 tests"
    pytest.skip(f"ZeRO-3: {entry} cannot be built under deepspeed.zero.Init: {reason} -- its _init_weights (run by "
                "post_init) calls torch.nn.init._calculate_fan_in_and_fan_out on the classifier's Linear weight, which "
                "zero.Init has already partitioned into an empty 1-D tensor (torch.nn.init's initialisers skip "
                "zero-element tensors, this direct call does not; transformers' own ZeRO-3 path, _from_config / "
                "from_pretrained under HfDeepSpeedConfig, skips the init and re-runs it gathered)")


class _ParameterFreeBeside(nn.Module):
    """A layer with parameters beside a parameter-free BatchNorm (AutoencoderKLFlux2.bn in small)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4, affine=False)


def _install_parameter_free_submodule(rank, world):
    deepspeed = init_deepspeed()
    zb.install()
    try:
        with deepspeed.zero.Init(config_dict_or_path=ZERO3_CONFIG):
            model = _ParameterFreeBeside()
        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
            if rank == 0:  # DeepSpeed's documented pattern: load on rank 0 only
                model.load_state_dict({**model.state_dict(), "bn.running_mean": torch.full((4,), 3.0)})
    finally:
        zb.uninstall()
    return model.bn.running_mean.tolist()


def test_install_commits_buffers_of_parameter_free_submodules(ranks2):
    assert ranks2.run(_install_parameter_free_submodule, timeout=120) == [[3.0] * 4] * 2


# ============================================================================================ harness

def run_table(world, names, case):
    """tests.helpers.run_table, each case's result with its duration on this rank ("t", seconds)."""
    import time

    def timed(name):
        t = time.perf_counter()
        out = case(name)
        if isinstance(out, dict):
            out["t"] = time.perf_counter() - t
        return out
    return _run_table(world, names, timed)


def _run(pool, body, *args):
    out = pool.run(body, *args, timeout=TIMEOUT)
    names = out[0][1]
    return [o[0] for o in out], names
