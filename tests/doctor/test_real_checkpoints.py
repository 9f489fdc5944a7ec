"""The checkpoint doctor on real checkpoints: inspect, diff and repair what DeepSpeed, torch, safetensors, DCP and
Accelerate wrote on 2 and 4 gloo ranks after training diverged BatchNorm statistics (tests/ckpt_kinds.py).

Every expectation is computed here from the ranks' own statistics (returned by the run that wrote the files),
not from the doctor's code; repaired checkpoints are read back by the real loaders (``engine.load_checkpoint``
on every rank, DeepSpeed's ``zero_to_fp32``, ``torch.load``, ``safetensors.torch.load_file``).
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

import zero_buffers as zb
from tests import ckpt_kinds
from tests.helpers import run_cmd
from zero_buffers import cli

_WRITTEN: dict[int, tuple[Path, list]] = {}
STATS = ("running_mean", "running_var", "num_batches_tracked")


def _written(pool, factory) -> tuple[Path, list]:
    """(folder, per-rank results) of ckpt_kinds.write_all at this world size, written once per session."""
    world = pool.world_size
    if world not in _WRITTEN:
        folder = factory.mktemp(f"kinds{world}")
        _WRITTEN[world] = (folder, pool.run(ckpt_kinds.write_all, str(folder), timeout=300))
    return _WRITTEN[world]


@pytest.fixture
def kinds(ranks, tmp_path_factory):
    return _written(ranks, tmp_path_factory)


@pytest.fixture
def kinds2(ranks2, tmp_path_factory):
    return _written(ranks2, tmp_path_factory)


def mixture(pres: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """average_bn_stats' definition, written out: ranks weighted by their counters, spread of the means included."""
    out = {}
    for key in pres[0]:
        if key.endswith("running_mean"):
            layer = key.removesuffix("running_mean")
            n = torch.tensor([float(p[layer + "num_batches_tracked"]) for p in pres], dtype=torch.float64)
            w = (n / n.sum())[:, None]
            means = torch.stack([p[key].double() for p in pres])
            var = torch.stack([p[layer + "running_var"].double() for p in pres])
            out[key] = (w * means).sum(0)
            out[layer + "running_var"] = (w * var).sum(0) + (w * (means - out[key]) ** 2).sum(0)
            out[layer + "num_batches_tracked"] = n.sum().to(torch.int64)
    return out


def assert_stats(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float = 1e-6) -> None:
    for key, value in want.items():
        torch.testing.assert_close(got[key].double(), value.double(), rtol=tol, atol=tol, msg=key)


def diverged(pres: list[dict[str, torch.Tensor]]) -> dict[str, tuple[int, ...]]:
    """Per statistic that some rank holds differently from rank 0: the ranks that differ (plus the rank-local tag)."""
    out = {k: tuple(r for r in range(1, len(pres)) if not torch.equal(pres[r][k], pres[0][k])) for k in pres[0]}
    out = {k: v for k, v in out.items() if v}
    out["7.tag"] = tuple(range(1, len(pres)))
    return out


def tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def zero_to_fp32(folder: Path) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    with contextlib.redirect_stdout(io.StringIO()):
        return get_fp32_state_dict_from_zero_checkpoint(str(folder))


def doctor(*args: str) -> tuple[int, str, str]:
    """The CLI in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(args))
    return code, out.getvalue(), err.getvalue()


# -- inspect: what each kind holds ------------------------------------------------------------------------------------

@pytest.mark.stack
def test_inspect_tells_each_kind_its_ranks_and_what_it_lost(ranks, kinds):
    folder, out = kinds
    world = ranks.world_size
    z3 = zb.checkpoint_report(folder / "zero3")
    assert (z3.kind, z3.tag, z3.per_rank, len(z3.sources)) == ("DeepSpeed ZeRO-3", "step8", True, world)
    assert z3.buffer_names and z3.kinds == (("BatchNorm statistics", 6), ("tag", 1))  # parameters are placeholders
    assert z3.counters == ((ckpt_kinds.STEPS, ckpt_kinds.STEPS),) * world and not z3.untrained
    for stage in (1, 2):
        r = zb.checkpoint_report(folder / f"zero{stage}")
        assert (r.kind, len(r.sources), r.compared) == (f"DeepSpeed ZeRO-{stage}", 1, False)
        assert f"the other {world - 1} rank(s)' buffers were never written" in r.format()
    acc = zb.checkpoint_report(folder / "accelerate")
    assert acc.kind == "Accelerate save_state" and not acc.compared and "main process only" in acc.format()
    for sub in ("pt", "safetensors"):
        r = zb.checkpoint_report(folder / sub)
        assert (r.kind, len(r.sources), r.per_rank, r.buffer_names) == ("per-rank files", world, True, False)
    code, text, _ = doctor("inspect", str(folder / "zero3"))
    assert code == 0 and f"{len(diverged([o['zero3'] for o in out]))} of 7 buffers differ" in text


def test_inspect_flags_untrained_batchnorm_statistics_on_the_ranks_that_hold_them(ranks, kinds, tmp_path):
    """Incident 1's signature: a rank whose BatchNorm layer still holds mean 0 / var 1 / count 0."""
    folder, _ = kinds
    copy = tmp_path / "pt"
    shutil.copytree(folder / "pt", copy)
    last = ranks.world_size - 1
    sd = torch.load(copy / f"rank{last}.pt")
    sd["2.running_mean"].zero_(), sd["2.running_var"].fill_(1), sd["2.num_batches_tracked"].zero_()
    torch.save(sd, copy / f"rank{last}.pt")
    report = zb.checkpoint_report(copy)
    assert report.untrained == (("2.", (last,)),)
    assert {r.name: r.untrained_ranks for r in report.report.rows if r.untrained_ranks} == {
        f"2.{s}": (last,) for s in STATS}
    assert f"on rank {last}" in report.format() and "incident 1" in report.format()
    assert zb.checkpoint_report(folder / "pt").untrained == ()


@pytest.mark.stack
def test_inspect_shows_which_rank_wrote_each_statistic_of_a_dcp_folder(ranks, kinds):
    """DCP keeps one copy per entry; find each entry's writer by matching it against every rank's statistics."""
    import torch.distributed.checkpoint as dcp

    folder, out = kinds
    pres = [o["ddp"] for o in out]
    loaded = {k: torch.empty_like(v) for k, v in pres[0].items()}
    dcp.load(loaded, checkpoint_id=str(folder / "dcp"), no_dist=True)
    writer = {k: [r for r, p in enumerate(pres) if torch.equal(p[k], v)] for k, v in loaded.items()}
    mixed = sorted({k.rsplit(".", 2)[0] for k in loaded if k.endswith("running_var")
                    if len({tuple(writer[f"{k.rsplit('.', 1)[0]}.{s}"]) for s in STATS[:2]}) > 1
                    and all(len(writer[f"{k.rsplit('.', 1)[0]}.{s}"]) == 1 for s in STATS[:2])})
    report = zb.checkpoint_report(folder / "dcp")
    assert report.kind == "torch DCP" and not report.compared
    if ranks.world_size == 2:
        assert mixed == ["0"]  # torch 2.13's planner: layer 0's running_mean from rank 0, running_var from rank 1
    text = " ".join(report.warnings)
    if mixed:
        assert "written by different ranks" in text
        for layer in mixed:
            m, v = writer[f"{layer}.running_mean"][0], writer[f"{layer}.running_var"][0]
            assert f"{layer} (running_mean from rank {m}, running_var from rank {v}" in text
    else:
        assert "each BatchNorm layer's statistics come from one rank's copy" in text


# -- diff: exactly the diverged buffers -----------------------------------------------------------------------------

@pytest.mark.parametrize("sub,run", [pytest.param("zero3", "zero3", marks=pytest.mark.stack), ("pt", "ddp"),
                                     ("safetensors", "ddp")])
def test_diff_finds_exactly_the_diverged_buffers(ranks, kinds, sub, run):
    folder, out = kinds
    pres = [o[run] for o in out]
    want = diverged(pres)
    report = zb.checkpoint_report(folder / sub)
    got = {r.name: r.differing_ranks for r in report.report.out_of_sync}
    assert got == want
    for row in report.report.rows:
        if row.name in pres[0]:
            worst = max(float((p[row.name].double() - pres[0][row.name].double()).abs().max()) for p in pres)
            assert row.max_abs_diff == pytest.approx(worst, rel=1e-12, abs=0)
    what = "buffers" if sub == "zero3" else "tensors"  # plain state dicts do not record which entries are buffers
    code, text, _ = doctor("diff", str(folder / sub))
    assert code == 1 and f"{len(want)} of {len(report.report.rows)} {what} differ" in text
    code, text, _ = doctor("diff", str(folder / sub), "--only", "*.tag")
    assert code == 1 and f"1 of 1 {what} differ" in text
    code, text, _ = doctor("diff", str(folder / sub), "--only", "*num_batches_tracked")
    assert code == 0 and f"0 of 2 {what} differ" in text  # every rank ran the same number of steps


@pytest.mark.stack
def test_diff_json_has_one_object_per_buffer_with_the_fields_of_buffer_row(ranks, kinds):
    folder, out = kinds
    code, text, _ = doctor("diff", str(folder / "zero3"), "--json")
    data = json.loads(text)
    assert code == 1 and data["in_sync"] is False and data["sources"] == [f"rank {r}" for r in range(ranks.world_size)]
    fields = {"name", "dtype", "shape", "in_sync", "max_abs_diff", "differing_ranks"}
    assert all(fields <= set(row) for row in data["buffers"])
    want = diverged([o["zero3"] for o in out])
    assert {row["name"]: tuple(row["differing_ranks"]) for row in data["buffers"] if not row["in_sync"]} == want
    mean = next(row for row in data["buffers"] if row["name"] == "0.running_mean")
    assert mean["dtype"] == "float32" and mean["shape"] == [3]


def test_diff_across_files_training_checkpoint_against_its_export(ranks, kinds):
    """zero_to_fp32's export carries rank 0's buffers: it agrees with rank 0 and differs from the others."""
    folder, out = kinds
    exported = folder / f"export{ranks.world_size}.pt"
    torch.save(zero_to_fp32(folder / "zero3"), exported)
    report = zb.checkpoint_report(exported, folder / "zero3")
    world = ranks.world_size
    assert report.sources[0] == str(exported) and len(report.sources) == 1 + world
    want = {k: tuple(r + 1 for r in v) for k, v in diverged([o["zero3"] for o in out]).items()}
    assert {r.name: r.differing_ranks for r in report.report.out_of_sync} == want  # source 1 (rank 0) agrees
    assert {r.name for r in report.report.rows} == set(out[0]["zero3"]) | {"7.tag"}  # the buffers all hold
    assert set(report.not_compared) == {k for k in torch.load(exported) if not k.endswith((*STATS, "tag"))}
    code, _, _ = doctor("diff", str(exported), str(folder / "zero3"), "--atol", "1e9")
    assert code == 0


# -- repair: the merged truth, read back by the real loaders ----------------------------------------------------------

def _load_repaired(rank, world, folder, truth, tag_src):
    from tests.helpers import init_deepspeed

    deepspeed = init_deepspeed()
    model = ckpt_kinds.site_net()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.05),
                                      config={"train_micro_batch_size_per_gpu": 16, "zero_optimization": {"stage": 3}})
    path, _ = engine.load_checkpoint(folder)
    stats = ckpt_kinds.bn_stats(engine.module)
    tag = engine.module[7].tag.tolist()
    steps = engine.global_steps
    engine.destroy()
    assert_stats(stats, truth)
    return path is not None, tag == [float(tag_src)] * 2, steps


@pytest.mark.stack
def test_repair_average_zero3_every_rank_loads_the_mixture_and_zero_to_fp32_agrees(ranks, kinds, tmp_path):
    folder, out = kinds
    world = ranks.world_size
    truth = mixture([o["zero3"] for o in out])
    before = tree_digest(folder / "zero3")
    code, text, _ = doctor("repair", str(folder / "zero3"), "-o", str(tmp_path / "fixed"))
    assert code == 0 and f"{world} rank file(s) rewritten and verified" in text
    assert tree_digest(folder / "zero3") == before  # the input is untouched
    fixed = tree_digest(tmp_path / "fixed")
    assert {k for k in fixed if fixed[k] != before.get(k)} == {
        f"step8/zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)}  # optimizer files: bytes
    assert_stats(zero_to_fp32(tmp_path / "fixed"), truth)
    loaded = ranks.run(_load_repaired, str(tmp_path / "fixed"), truth, 0, timeout=120)
    assert loaded == [(True, True, ckpt_kinds.STEPS)] * world  # every rank: the mixture, rank 0's tag, its step
    code, _, _ = doctor("diff", str(tmp_path / "fixed"))
    assert code == 0


@pytest.mark.stack
def test_a_repaired_zero3_checkpoint_recovers_the_accuracy_average_bn_stats_would_have_given(ranks, kinds, tmp_path):
    folder, _ = kinds
    world = ranks.world_size
    zb.repair_checkpoint(folder / "zero3", tmp_path / "fixed", policy="average")

    def acc(path: Path) -> tuple[float, dict[str, torch.Tensor]]:
        model = ckpt_kinds.site_net()
        sd = zero_to_fp32(path)
        model.load_state_dict(sd)
        return ckpt_kinds.accuracy(model, world), {k: v for k, v in sd.items() if k.endswith(STATS)}

    default, _ = acc(folder / "zero3")
    averaged, want = acc(folder / "zero3_averaged")  # average_bn_stats on the ranks before saving
    repaired, got = acc(tmp_path / "fixed")
    assert_stats(got, want)
    assert repaired == averaged > default


@pytest.mark.parametrize("sub", ["pt", "safetensors"])
def test_repair_per_rank_files(ranks, kinds, tmp_path, sub):
    from safetensors import safe_open
    from safetensors.torch import load_file

    folder, out = kinds
    world = ranks.world_size
    pres = [o["ddp"] for o in out]
    src = world - 1
    read = load_file if sub == "safetensors" else lambda p: torch.load(p, weights_only=True)
    files = sorted((folder / sub).iterdir())
    result = zb.repair_checkpoint(folder / sub, tmp_path / "avg", policy="average", src=src)
    assert result.merged == ("0", "2") and result.from_src == ("7.tag",)
    truth = mixture(pres)
    for f in files:
        original, repaired = read(f), read(tmp_path / "avg" / f.name)
        assert_stats(repaired, truth)
        assert repaired["7.tag"].tolist() == [float(src)] * 2
        for k, v in original.items():  # the weights are untouched, bit for bit
            if not k.endswith((*STATS, "tag")):
                assert torch.equal(repaired[k], v), k
    if sub == "safetensors":
        with safe_open(str(tmp_path / "avg" / files[0].name), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
    zb.repair_checkpoint(folder / sub, tmp_path / "bcast", policy="broadcast", src=src)
    for f in files:
        repaired = read(tmp_path / "bcast" / f.name)
        assert_stats(repaired, pres[src], tol=0)
    assert zb.checkpoint_report(tmp_path / "bcast").in_sync and zb.checkpoint_report(tmp_path / "avg").in_sync


def test_repair_in_place_swaps_the_tag_folder(kinds2, tmp_path):
    folder, out = kinds2
    copy = tmp_path / "z3"
    shutil.copytree(folder / "zero3", copy)
    optim = (copy / "step8" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").read_bytes()
    code, _, _ = doctor("repair", str(copy), "--in-place")
    assert code == 0
    assert_stats(zero_to_fp32(copy), mixture([o["zero3"] for o in out]))
    assert (copy / "step8" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").read_bytes() == optim
    assert sorted(p.name for p in tmp_path.iterdir()) == ["z3"]  # no staging or old folder left behind
    assert sorted(p.name for p in copy.iterdir()) == sorted(p.name for p in (folder / "zero3").iterdir())


def test_repair_refuses_kinds_with_one_copy(kinds2, tmp_path):
    folder, _ = kinds2
    for sub in ("zero1", "zero2", "accelerate", "dcp", "pt/rank0.pt"):
        code, _, err = doctor("repair", str(folder / sub), "-o", str(tmp_path / "out"))
        assert code == 2 and "nothing to repair" in err, sub
    assert not (tmp_path / "out").exists()


# -- bad input: exit 2, a message naming the file, the input untouched, no partial output ----------------------------

def _damaged(kinds, tmp_path, damage) -> Path:
    folder, _ = kinds
    copy = tmp_path / "in"
    shutil.copytree(folder / "zero3", copy)
    damage(copy / "step8")
    return copy


def _model_file(step: Path, r: int) -> Path:
    return step / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"


def _edit(step: Path, r: int, change) -> None:
    sd = torch.load(_model_file(step, r), weights_only=True)
    change(sd["module"])
    torch.save(sd, _model_file(step, r))


def _zero_bytes(file: Path, at: int) -> None:
    data = bytearray(file.read_bytes())
    data[at:at + 64] = bytes(64)
    file.write_bytes(data)


BAD = {
    "missing rank": (lambda s: _model_file(s, 1).unlink(), "rank file(s) missing for rank(s) [1]", 1),
    "extra rank": (lambda s: shutil.copy(_model_file(s, 0), _model_file(s, 7)), "data-parallel world of", 7),
    "other buffers": (lambda s: _edit(s, 1, lambda m: m.pop("7.tag")), "different set of buffers", 1),
    "other shape": (lambda s: _edit(s, 1, lambda m: m.__setitem__("2.running_mean", torch.zeros(5))),
                    "2.running_mean is float32 [5] on rank 1 but float32 [8] on rank 0", 1),
    "truncated": (lambda s: _model_file(s, 1).write_bytes(_model_file(s, 1).read_bytes()[:900]),
                  "truncated or corrupt", 1),
    "not a checkpoint": (lambda s: _model_file(s, 1).write_text("hello\n"), "not a torch checkpoint", 1),
    "corrupt tail": (lambda s: _zero_bytes(_model_file(s, 1), -200), "truncated or corrupt", 1),
    "pickled object": (lambda s: torch.save({"module": {"x": torch.zeros(1)}, "f": Path("x")}, _model_file(s, 1)),
                       "weights_only=True refuses", 1),
}


def test_repair_refuses_a_file_whose_data_fails_its_crc_check(kinds2, tmp_path):
    """Zeroed bytes inside a tensor's data load silently (mmap, no CRC check): repair checks the CRCs first."""
    copy = _damaged(kinds2, tmp_path, lambda s: _zero_bytes(_model_file(s, 1), _model_file(s, 1).stat().st_size // 2))
    before = tree_digest(copy)
    code, _, err = doctor("repair", str(copy), "-o", str(tmp_path / "out"))
    assert code == 2 and "fails its CRC-32 check" in err and _model_file(Path("step8"), 1).name in err
    assert tree_digest(copy) == before and sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_corrupt_data_is_an_error_for_diff_too_not_a_difference(kinds2, tmp_path):
    copy = _damaged(kinds2, tmp_path, lambda s: _zero_bytes(_model_file(s, 1), _model_file(s, 1).stat().st_size // 2))
    code, _, err = doctor("diff", str(copy))
    assert code == 2 and "fails its CRC-32 check" in err
    code, _, _ = doctor("diff", str(copy), "--no-verify")
    assert code == 1  # unchecked, the zeroed bytes read as a difference


def test_a_checkpoint_dict_with_the_model_nested_and_other_tensors_beside_it(kinds2, tmp_path):
    folder, out = kinds2
    (tmp_path / "ck").mkdir()
    for f in sorted((folder / "pt").iterdir()):
        torch.save({"model": torch.load(f), "rng": torch.get_rng_state(), "step": 8}, tmp_path / "ck" / f.name)
    report = zb.checkpoint_report(tmp_path / "ck")
    assert {r.name for r in report.report.out_of_sync} == set(diverged([o["ddp"] for o in out]))  # not "rng"


def test_an_accelerate_folder_with_two_models_compares_neither_with_the_other(kinds2, tmp_path):
    folder, _ = kinds2
    copy = tmp_path / "acc"
    shutil.copytree(folder / "accelerate", copy)
    shutil.copy(folder / "safetensors" / "model-rank1.safetensors", copy / "model_1.safetensors")
    report = zb.checkpoint_report(copy)
    assert report.sources == ("model.safetensors",) and not report.compared
    assert "model_1.safetensors" in report.format()


def test_an_output_folder_that_cannot_be_made_exits_2(kinds2, tmp_path):
    folder, _ = kinds2
    (tmp_path / "file").write_text("x")
    code, _, err = doctor("repair", str(folder / "pt"), "-o", str(tmp_path / "file" / "out"))
    assert code == 2 and "cannot create its parent folder" in err


def test_progress_bar_for_many_files_goes_to_stderr(kinds2, capsys):
    folder, _ = kinds2
    zb.checkpoint_report(folder / "zero3", progress=True)
    assert "reading" in capsys.readouterr().err
    zb.checkpoint_report(folder / "zero3")  # default: only for 8 or more files on a terminal
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_exits_2_naming_the_file_and_changes_nothing(kinds2, tmp_path, case):
    damage, message, rank = BAD[case]
    copy = _damaged(kinds2, tmp_path, damage)
    before = tree_digest(copy)
    for args in (["inspect", str(copy)], ["diff", str(copy)], ["repair", str(copy), "-o", str(tmp_path / "out")],
                 ["repair", str(copy), "--in-place"]):
        code, _, err = doctor(*args)
        assert code == 2 and message in err and _model_file(Path("step8"), rank).name in err, (args, err)
    assert tree_digest(copy) == before and sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_trust_pickle_reads_a_file_weights_only_refuses_and_says_so(kinds2, tmp_path):
    folder, _ = kinds2
    (tmp_path / "pt").mkdir()
    for f in sorted((folder / "pt").iterdir()):
        torch.save({"state_dict": torch.load(f), "note": Path("run-7")}, tmp_path / "pt" / f.name)
    code, _, err = doctor("diff", str(tmp_path / "pt"))
    assert code == 2 and "PosixPath" in err and "--trust-pickle" in err
    with pytest.warns(zb.ZeroBuffersWarning, match="arbitrary code"):
        code, text, err = doctor("diff", str(tmp_path / "pt"), "--trust-pickle")
    assert code == 1 and "5 of 14 tensors differ" in text
    from zero_buffers._core import notice as _notice
    _notice._SEEN.discard("trust_pickle")


def test_output_inside_the_input_or_existing_is_refused(kinds2, tmp_path):
    folder, _ = kinds2
    copy = tmp_path / "in"
    shutil.copytree(folder / "zero3", copy)
    before = tree_digest(copy)
    for out, message in ((copy / "fixed", "inside the input"), (copy / "step8" / "x", "inside the input"),
                         (copy, "already exists")):
        code, _, err = doctor("repair", str(copy), "-o", str(out))
        assert code == 2 and message in err, err
    assert tree_digest(copy) == before


_LIMITED = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), int(sys.argv[1])))
from zero_buffers import cli
sys.exit(cli.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("sub,in_place", [("zero3", False), ("zero3", True), ("safetensors", False)])
def test_a_full_disk_mid_repair_leaves_the_input_as_it_was_and_no_partial_output(kinds2, tmp_path, sub,
                                                                                    in_place):
    """A file-size limit makes the real writers fail part-way (torch.save raises RuntimeError, not OSError)."""
    folder, _ = kinds2
    copy = tmp_path / "in"
    shutil.copytree(folder / sub, copy)
    before = tree_digest(copy)
    limit = min(p.stat().st_size for p in copy.rglob("*") if p.name.endswith(("model_states.pt", ".safetensors"))) // 2
    args = ["repair", str(copy), "--in-place"] if in_place else ["repair", str(copy), "-o", str(tmp_path / "out")]
    done = run_cmd([sys.executable, "-c", _LIMITED, str(limit), *args], 120, env=dict(os.environ))
    assert done.returncode == 2, done.stderr
    assert "the input is unchanged and nothing was written" in done.stderr, done.stderr
    assert tree_digest(copy) == before and sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_the_installed_command_exits_1_when_buffers_differ(kinds2):
    folder, _ = kinds2
    done = run_cmd([sys.executable, "-m", "zero_buffers.cli", "diff", str(folder / "zero3")], 120)
    assert done.returncode == 1 and "NO" in done.stdout
    done = run_cmd([sys.executable, "-m", "zero_buffers.cli", "diff", str(folder / "nothing-here")], 120)
    assert done.returncode == 2 and "no such file or folder" in done.stderr
