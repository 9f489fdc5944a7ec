"""Differential tests of the drop-in: every body runs three ways inside the rank workers, and the parameters must
come out the same.

* ``deepspeed``: DeepSpeed 0.19.8's ``deepspeed.zero.GatheredParameters`` as shipped (the reference);
* ``ours``: ``zero_buffers.GatheredParametersAndBuffers`` (for transformers' call sites: swapped in as
  ``deepspeed.zero.GatheredParameters``, which transformers looks up at call time);
* ``installed``: DeepSpeed's own class after ``zero_buffers.install()`` (undone in ``finally`` inside the body:
  pool workers are reused, a patch left behind would leak into the next test).

Buffers may differ from DeepSpeed only where zero_buffers is meant to do more: under ``install()`` a
``modifier_rank=r`` context broadcasts the buffers of the modules owning the gathered parameters, and only when
the body changed them on rank r; ``GatheredParametersAndBuffers`` given parameters (not modules) commits the
buffers of the modules that own them whatever the body did, as it does for the modules it is given
(tests/zero3/test_param_list_owners.py tests how the owners are found).

Intended differences, asserted where they show: a body that raises with ``modifier_rank=r`` commits nothing
(DeepSpeed commits rank r's half-done values); ours raises InvalidArgumentError on items that are neither
tensors, modules nor None (DeepSpeed silently ignores them); ours takes modules; ``__enter__`` of ours returns
the context (DeepSpeed's returns None). Behaviours from DeepSpeed's own unit tests are written anew here (the
facts are in /work/notes/gathered.md section 3); the call-site forms are those of section 1.
"""
from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero_buffers as zb
from tests.helpers import (
    DS_NESTING_CHECK,
    DS_SANITY_WRITE_CHECK,
    HF5,
    ZERO3_CONFIG,
    buffers,
    init_deepspeed,
    log_collectives,
    log_deepspeed_comm,
    restore_collectives,
    same_state,
)
from tests.multirank import RankFailure

# the tests of what DeepSpeed, transformers and Accelerate do: run on both dependency stacks (.ci/run)
pytestmark = pytest.mark.stack

KINDS = ("deepspeed", "ours", "installed")
DEPTH = "_ds_z3_gathered_param_context_depth"
OVERLAP = "Nested GatheredParameters contexts cannot overlap parameters"


# ---- harness -------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def implementation(kind: str, swap: bool = False):
    """The GatheredParameters class a body uses. ``swap``: for ours, also rebind ``deepspeed.zero.GatheredParameters``
    (what transformers and accelerate call); always put back, and install() always undone, before the body returns."""
    deepspeed = init_deepspeed()
    assert not zb.installed(), "an earlier test left zero_buffers.install() active in this worker"
    real = deepspeed.zero.GatheredParameters
    if kind == "installed":
        zb.install()
    elif kind == "ours" and swap:
        deepspeed.zero.GatheredParameters = zb.GatheredParametersAndBuffers
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # install()'s "no ZeRO parameter" notice
            yield zb.GatheredParametersAndBuffers if kind == "ours" else real
    finally:
        deepspeed.zero.GatheredParameters = real
        zb.uninstall()


def _differential(rank, world, body, kind, *args):
    torch.manual_seed(0)  # parameters start equal across ranks AND across kinds
    with implementation(kind) as GP:
        return body(rank, world, GP, kind, *args)


def run3(pool, body, *args, timeout: float = 120, kinds=KINDS) -> dict:
    """``body(rank, world, GP, kind, *args)`` on every rank, once per kind: {kind: [result by rank]}."""
    out = {}
    for kind in kinds:
        try:
            out[kind] = pool.run(_differential, body, kind, *args, timeout=timeout)
        except RankFailure as e:
            raise RankFailure(f"[{kind}] {e}") from None
    return out


def assert_same_params(out: dict, key: str = "params") -> None:
    """The differential core: every kind ends with DeepSpeed's parameters, bit for bit, on every rank."""
    ref = out["deepspeed"]
    for kind, results in out.items():
        for rank, (mine, theirs) in enumerate(zip(results, ref)):
            assert same_state(mine[key], theirs[key]), f"{kind}, rank {rank}: parameters differ from DeepSpeed's"


class Net(nn.Module):
    """A Linear, a BatchNorm (owner of its running statistics), a bias-free Linear (a None bias, as GPT-2's head)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)
        self.head = nn.Linear(3, 2, bias=False)


def mark(bn: nn.BatchNorm1d, rank: int) -> None:
    """Per-rank BatchNorm statistics: rank r has mean r+1, var 10+r, count r."""
    with torch.no_grad():
        bn.running_mean.fill_(rank + 1)
        bn.running_var.fill_(10 + rank)
        bn.num_batches_tracked.fill_(rank)


def build(rank: int, config: dict = ZERO3_CONFIG) -> Net:
    import deepspeed
    with deepspeed.zero.Init(config_dict_or_path=config):
        net = Net()
    mark(net.bn, rank)  # after construction: install()'s zero.Init sync has run by now in every kind
    return net


def released(p: torch.Tensor) -> bool:
    """Re-partitioned and no GatheredParameters context left holding it."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    return p.ds_status == ZeroParamStatus.NOT_AVAILABLE and p.numel() == 0 and not hasattr(p, DEPTH)


def observe(net: nn.Module) -> dict:
    """Full parameters (a read-only DeepSpeed gather: modifier_rank=None is DeepSpeed's own in every kind),
    buffers, and whether everything was re-partitioned."""
    import deepspeed
    zero = [p for p in net.parameters() if hasattr(p, "ds_id")]
    free = all(released(p) for p in zero)
    with deepspeed.zero.GatheredParameters(zero):
        params = {n: p.detach().clone() for n, p in net.named_parameters()}
    return {"params": params, "buffers": buffers(net), "free": free}


# ---- modifier_rank: the call-site forms ------------------------------------------------------------------------
FORMS = ("lone", "list_with_none", "generator", "params_keyword", "list_from_set", "recurse_false")
BN_GATHERED = {"lone": False, "list_with_none": True, "generator": True, "params_keyword": True,
               "list_from_set": True, "recurse_false": True}  # whether the form gathers the BatchNorm's parameters


def _modify(rank, world, GP, kind, form, mr, writer):
    net = build(rank)
    plain = nn.Parameter(torch.full((2,), float(rank)))  # not ZeRO: every form ignores it
    writes = writer == "all" or rank != mr  # "others": the modifier rank only reads
    index = {id(p): i for i, p in enumerate(net.parameters())}  # not ds_id: it keeps counting in a reused worker

    def body(gathered, bn_buffers=True):
        if not writes:
            return
        with torch.no_grad():
            for p in gathered:
                if p is not None and hasattr(p, "ds_id"):
                    p.fill_(100 * rank + index[id(p)])
            plain.fill_(7 + rank)
            if bn_buffers:
                net.bn.running_mean.fill_(50 + rank)

    if form == "recurse_false":  # DeepSpeed's documented per-module loading walk (the root owns no parameter)
        for m in net.modules():
            own = list(m.parameters(recurse=False))
            with GP(own, modifier_rank=mr):
                body(own, bn_buffers=m is net.bn)
    else:
        if form == "lone":
            arg = net.lin.weight
        elif form == "list_with_none":  # transformers' [old.weight, old.bias, new.weight, new.bias] with None biases
            arg = [net.bn.weight, net.head.bias, net.head.weight, None, plain]
        elif form == "generator":
            arg = net.parameters()
        elif form == "params_keyword":
            arg = [net.bn.bias]
        else:  # transformers 5.24 _initialize_missing_keys: a list built from a set, buffers included
            arg = list({*net.state_dict(keep_vars=True).values(), plain})
            if rank % 2:
                arg.reverse()  # the set order differs between ranks: guarantee it does here
        gathered = list(net.parameters()) if form == "generator" else [arg] if form == "lone" else list(arg)
        ctx = GP(params=arg, modifier_rank=mr) if form == "params_keyword" else GP(arg, modifier_rank=mr)
        with ctx:
            inside = [p.numel() for p in gathered if p is not None and hasattr(p, "ds_id")]
            body(gathered)
        assert all(n > 0 for n in inside), "not gathered inside the context"
    return {**observe(net), "plain": plain.detach().clone(), "index": {n: i for i, (n, _) in
                                                                       enumerate(net.named_parameters())}}


def check_modify(out: dict, form: str, mr: int, writer: str) -> None:
    assert_same_params(out)
    world = len(out["deepspeed"])
    for kind, results in out.items():
        for rank, res in enumerate(results):
            assert res["free"], f"{kind}: not re-partitioned"
            writes = writer == "all" or rank != mr
            assert float(res["plain"][0]) == (7 + rank if writes else rank)  # never broadcast
            if writer == "all":  # the modifier rank's writes reached every rank (DeepSpeed's own behaviour)
                index = res["index"]
                names = {"lone": ["lin.weight"], "params_keyword": ["bn.bias"],
                         "list_with_none": ["bn.weight", "head.weight"]}.get(form, list(index))
                for n in names:
                    assert torch.equal(res["params"][n], torch.full_like(res["params"][n], 100 * mr + index[n])), n
            # buffers: DeepSpeed leaves them per rank; ours broadcasts the owners' buffers (the BatchNorm's, when its
            # parameters are given), install() only when the modifier rank changed them
            broadcast = BN_GATHERED[form] and (kind == "ours" or (kind == "installed" and writer == "all"))
            src = mr if broadcast else rank
            mean = 50 + src if (writer == "all" or src != mr) else src + 1
            want = {"bn.running_mean": float(mean), "bn.running_var": float(10 + src),
                    "bn.num_batches_tracked": float(src)}
            got = {k: float(res["buffers"][k].reshape(-1)[0]) for k in want}
            assert got == want, f"{kind}, rank {rank} of {world}: {got} != {want}"


@pytest.mark.parametrize("mr,writer", [(0, "all"), (1, "all"), (0, "others")],
                         ids=["mr0", "mr1", "mr0-read-only-on-modifier"])
@pytest.mark.parametrize("form", FORMS)
def test_modifier_rank_forms(ranks2, form, mr, writer):
    check_modify(run3(ranks2, _modify, form, mr, writer), form, mr, writer)


@pytest.mark.parametrize("mr", [1, 3])
@pytest.mark.parametrize("form", ["lone", "generator"])
def test_modifier_rank_honoured_on_four_ranks(ranks4, form, mr):
    """Not only rank 0: DeepSpeed broadcasts from the rank named (its own test: rank 1 zeroes, all see zeros)."""
    check_modify(run3(ranks4, _modify, form, mr, "all"), form, mr, "all")


# ---- no ZeRO parameter: a no-op without any collective ---------------------------------------------------------
def _no_zero_on_rank0_only(rank, world, GP, kind, what):
    net = build(rank)
    dist.barrier()
    outcome, log = None, []
    if rank == 0:
        arg, kw = {"tensor": (torch.empty(3), {}), "parameter": (nn.Parameter(torch.ones(2)), {}),
                   "none": (None, {}), "empty": ([], {}), "none_list": ([None, None], {}),
                   "name_param_tuples": ([("lin.weight", net.lin.weight)], {}),
                   "module": (nn.Linear(2, 2), {}), "module_list": (nn.ModuleList([nn.Linear(2, 2)]), {}),
                   "zero_disabled": (net.lin.weight, {"enabled": False})}[what]
        real = log_collectives(log)
        undo = log_deepspeed_comm(log)
        try:
            with GP(arg, modifier_rank=0, **kw):
                outcome = "ran"
        except Exception as e:  # noqa: BLE001 - reported to the parent
            outcome = f"{type(e).__name__}: {e}"
        finally:
            undo()
            restore_collectives(real)
    dist.barrier()  # a rank-0-only collective would leave this barrier mismatched or hung
    return outcome, log


NO_ZERO = ("tensor", "parameter", "none", "empty", "none_list", "name_param_tuples", "module", "module_list",
           "zero_disabled")


@pytest.mark.parametrize("what", NO_ZERO)
def test_no_zero_parameter_on_rank0_only_issues_no_collective(ranks2, what):
    """DistilBERT in transformers 5.24 calls GatheredParameters(plain tensor, modifier_rank=0) on rank 0 alone."""
    # ours takes modules (gathers them, broadcasts their buffers): not a no-op by design, so not run rank-0-only
    kinds = [k for k in KINDS if not (k == "ours" and what in ("module", "module_list"))]
    out = run3(ranks2, _no_zero_on_rank0_only, what, timeout=60, kinds=kinds)
    for kind, ((outcome, log), _) in out.items():
        assert log == [], f"{kind}: {what} issued collectives {log}"
        if kind == "ours" and what == "name_param_tuples":  # intended: a typed error where DeepSpeed does nothing
            assert outcome.startswith("InvalidArgumentError") and "item 0 is a tuple" in outcome, outcome
        else:
            assert outcome == "ran", f"{kind}: {outcome}"


# ---- nesting -----------------------------------------------------------------------------------------------------
def _nested(rank, world, GP, kind, overlap, inner_mr, who):
    net = build(rank)
    lin, bn = net.lin, net.bn
    seen = {"error": None, "ran": False}
    with GP(list(lin.parameters()), modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                lin.weight.fill_(5.0)  # the outer context still commits after the inner one failed
        if who == "all" or rank == 0:
            inner = [lin.bias, bn.weight] if overlap else [bn.weight]  # overlap: partial (bn.weight is new)
            try:
                with GP(inner, modifier_rank=inner_mr):
                    seen["ran"] = True
                    seen["inner_gathered"] = bn.weight.numel() == 3
                    if rank == 0 and inner_mr == 0:
                        with torch.no_grad():
                            bn.weight.fill_(9.0)
            except RuntimeError as e:  # DeepSpeed's; ours are ZeroBuffersError / SyncAbortedError (RuntimeErrors)
                seen["error"] = (type(e).__name__, str(e))
        seen["bn_released"] = released(bn.weight)  # the inner context's own parameter: gathered or not, let go
        seen["outer_held"] = all(p.numel() > 0 and getattr(p, DEPTH, 1) == 1 for p in lin.parameters())
    seen["lin_bias_id"] = lin.bias.ds_id
    return {**observe(net), **seen}


@pytest.mark.parametrize("overlap,inner_mr,who", [
    (False, None, "all"), (False, 0, "all"), (True, None, "all"), (True, 0, "all"), (True, None, "rank0"),
    (True, 0, "rank0")], ids=["disjoint-read", "disjoint-mr0", "overlap-read", "overlap-mr0",
                              "overlap-read-rank0-only", "overlap-mr0-rank0-only"])
def test_nested_contexts(ranks2, overlap, inner_mr, who):
    """Disjoint nesting works; an overlap (partial here) raises before the inner body on every rank that opened it,
    gathers nothing more, and leaves the outer context intact. Rank-0-only: transformers' _from_config runs
    _init_weights on rank 0 alone inside an outer context (Hubert's Conv1d, PatchTST), so the error must be local,
    with no collective the peer would not join."""
    if overlap and not DS_NESTING_CHECK:
        pytest.skip("DeepSpeed < 0.19.4 neither refuses overlapping nested GatheredParameters nor marks held ones")
    out = run3(ranks2, _nested, overlap, inner_mr, who, timeout=60)
    assert_same_params(out)
    for kind, results in out.items():
        for rank, res in enumerate(results):
            opened = who == "all" or rank == 0
            assert res["outer_held"] and res["free"] and res["bn_released"], kind
            assert torch.equal(res["params"]["lin.weight"], torch.full((3, 4), 5.0))
            if overlap and opened:
                _, text = res["error"]
                assert not res["ran"] and OVERLAP in text and f"[{res['lin_bias_id']}]" in text, (kind, text)
            else:
                assert res["error"] is None and res["ran"] == opened and res.get("inner_gathered", True), kind
            want_bn = 9.0 if (not overlap and inner_mr == 0) else 1.0
            assert torch.equal(res["params"]["bn.weight"], torch.full((3,), want_bn)), kind


# ---- what DeepSpeed's own unit tests pin ---------------------------------------------------------------------------
def _basics(rank, world, GP, kind):
    """Partitioned until gathered, full inside, freed after; fwd_module registers at construction; enabled=False
    does nothing; what __enter__ returns; a module built outside zero.Init is left alone."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    net = build(rank)
    w = net.lin.weight
    seen = {"before": (w.ds_status == ZeroParamStatus.NOT_AVAILABLE, tuple(w.shape), w.numel())}
    with GP(w) as entered:
        seen["inside"] = (w.ds_status == ZeroParamStatus.AVAILABLE, w.numel())
        seen["entered"] = type(entered).__name__
    seen["after_lone"] = released(w)
    with GP(list(net.parameters()), modifier_rank=0):
        seen["all_inside"] = all(p.numel() > 0 for p in net.parameters())
    seen["after_all"] = all(released(p) for p in net.parameters())
    ctx = GP(net.head.weight, fwd_module=net)  # constructed, not (yet) entered
    seen["external"] = any(p is net.head.weight for p in getattr(net, "_external_params", {}).values())
    with ctx:
        seen["external_inside"] = net.head.weight.numel() == 6
    with GP(list(net.parameters()), modifier_rank=0, enabled=False):
        seen["disabled_inside"] = all(p.numel() == 0 for p in net.parameters())
        if rank == 0:
            mark(net.bn, 40)  # rank 0 changes the owner's buffers: still nothing is broadcast
    outside = nn.Linear(3, 2)  # no ZeRO: no ds_status, full size, GatheredParameters a no-op
    with GP(outside.weight, modifier_rank=0):
        seen["outside"] = (not hasattr(outside.weight, "ds_status"), outside.weight.numel())
    return {**observe(net), **seen}


def test_deepspeed_unit_test_behaviours(ranks2):
    out = run3(ranks2, _basics, timeout=60)
    assert_same_params(out)
    for kind, results in out.items():
        for rank, res in enumerate(results):
            assert res["before"] == (True, (0,), 0) and res["inside"] == (True, 12), kind
            assert res["after_lone"] and res["all_inside"] and res["after_all"] and res["free"], kind
            assert res["external"] and res["external_inside"], kind
            assert res["disabled_inside"] and res["outside"] == (True, 6), kind
            # DeepSpeed's __enter__ returns None; ours returns the context (harmless for `with ... :` callers)
            assert res["entered"] == ("GatheredParametersAndBuffers" if kind == "ours" else "NoneType"), kind
            # ours also committed rank 0's buffers in the whole-model modifier_rank=0 context (its owners' buffers)
            want = 41.0 if rank == 0 else 1.0 if kind == "ours" else rank + 1
            assert float(res["buffers"]["bn.running_mean"][0]) == want, kind


SANITY_CONFIG = {**ZERO3_CONFIG, "zero_optimization": {"stage": 3, "enable_sanity_checks": True}}


def _sanity(rank, world, GP, kind, who):
    net = build(rank, SANITY_CONFIG)
    error = None
    try:
        with GP([net.lin.weight, net.head.weight]):  # modifier_rank=None
            if who == "all" or rank == world - 1:
                with torch.no_grad():
                    net.lin.weight.add_(0.0)  # an in-place change with nobody to broadcast it
    except RuntimeError as e:
        error = str(e)
    return {**observe(net), "error": error}


@pytest.mark.parametrize("who", ["all", "last"])
def test_sanity_checks_catch_writes_with_modifier_rank_none_on_every_rank(ranks2, who):
    if not DS_SANITY_WRITE_CHECK:
        pytest.skip("DeepSpeed < 0.18.7 does not check modifier_rank=None contexts for in-place writes")
    out = run3(ranks2, _sanity, who, timeout=60)
    assert_same_params(out)
    for kind, results in out.items():
        for res in results:
            assert res["free"] and res["error"] and "in-place modification" in res["error"], kind


def _body_raises(rank, world, GP, kind, mr):
    net = build(rank)
    error = None
    try:
        with GP([net.lin.weight, net.bn.weight], modifier_rank=mr):
            if rank == 0:
                with torch.no_grad():
                    net.lin.weight.fill_(5.0)
                    mark(net.bn, 50)
            if rank == world - 1:
                raise ValueError("bad file")
    except (ValueError, zb.ZeroBuffersError) as e:
        error = (type(e).__name__, getattr(e, "ranks", None))
    return {**observe(net), "error": error}


@pytest.mark.parametrize("mr", [0, None], ids=["mr0", "read-only"])
def test_body_raising(ranks2, mr):
    """The exception propagates where it was raised and the depth bookkeeping is undone in every kind. With
    modifier_rank set, DeepSpeed still broadcasts rank 0's half-done values; ours and install() commit nothing and
    tell the other ranks (intended: all or nothing)."""
    out = run3(ranks2, _body_raises, mr, timeout=60)
    last = len(out["deepspeed"]) - 1
    for kind, results in out.items():
        for rank, res in enumerate(results):
            assert res["free"], kind
            committed = kind == "deepspeed" and mr == 0
            assert torch.equal(res["params"]["lin.weight"] == 5.0, torch.full((3, 4), committed)), (kind, rank)
            if rank == last:
                assert res["error"] == ("ValueError", None), kind
            elif mr is None or kind == "deepspeed":
                assert res["error"] is None, kind
            else:
                assert res["error"] == ("SyncAbortedError", (last,)), kind
            # rank 0's buffer writes: kept by DeepSpeed (not its business), rolled back by ours and install(), which
            # commit the owners' buffers with the parameters
            kept = rank == 0 and not (kind in ("ours", "installed") and mr is not None)
            assert float(res["buffers"]["bn.running_mean"][0]) == (51.0 if kept else rank + 1), (kind, rank)


class Layered(nn.Module):
    """Fills its layers inside __init__ while zero.Init is active (DeepSpeed's many-params test does this)."""

    GP = None  # the class under test, set by the body

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(3))
        rank = dist.get_rank()
        for k, layer in enumerate(self.layers):
            with Layered.GP(layer.weight, modifier_rank=0):
                with torch.no_grad():
                    layer.weight.fill_(2.0 * k + rank)  # every rank writes; rank 0's values win


def _in_module_init(rank, world, GP, kind, under_init):
    import deepspeed
    Layered.GP = GP
    try:
        with deepspeed.zero.Init(config_dict_or_path=ZERO3_CONFIG, enabled=under_init):
            model = Layered()
    finally:
        Layered.GP = None
    if not under_init:  # plain parameters: GatheredParameters was a no-op, each rank kept its own values
        return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    return observe(model)


@pytest.mark.parametrize("under_init", [True, False], ids=["zero-init", "plain"])
def test_gathered_inside_module_init(ranks2, under_init):
    out = run3(ranks2, _in_module_init, under_init, timeout=60)
    assert_same_params(out)
    for rank, res in enumerate(out["deepspeed"]):
        for k in range(3):
            want = 2.0 * k + (0 if under_init else rank)
            assert torch.equal(res["params"][f"layers.{k}.weight"], torch.full((3, 3), want))


# ---- transformers' call sites, with ours swapped in / install() active ------------------------------------------
def _hf(rank, world, kind, case, path):
    from tests.hf_tiny import zero3_switched_on
    torch.manual_seed(0 if case == "resize" else rank)
    with implementation(kind, swap=True):
        with zero3_switched_on("hf_config", ZERO3_CONFIG):
            if case == "resize":
                from transformers import GPT2Config, GPT2LMHeadModel
                config = GPT2Config(vocab_size=20, n_embd=8, n_layer=1, n_head=2, n_positions=8,
                                    tie_word_embeddings=False)  # lm_head: no bias -> [Z, None, T, None], mr=0
                model = GPT2LMHeadModel._from_config(config)
                before = observe_any(model)
                torch.manual_seed(1)  # again: _from_config ran _init_weights on rank 0 alone, its RNG moved on
                model.resize_token_embeddings(24)
                return {"before": before, **observe_any(model)}
            if case == "distilbert":
                from transformers import DistilBertConfig, DistilBertModel
                config = DistilBertConfig(vocab_size=20, dim=8, n_layers=1, n_heads=2, hidden_dim=8,
                                          max_position_embeddings=6, pad_token_id=None, sinusoidal_pos_embds=True)
                return observe_any(DistilBertModel._from_config(config))  # rank 0 alone: GP(plain tensor, mr=0)
            from tests.hf_tiny import TinyModel
            return observe_any(TinyModel.from_pretrained(path))


def observe_any(model: nn.Module) -> dict:
    """observe() for a model with ZeRO and plain parameters."""
    import deepspeed
    zero = [p for p in model.parameters() if hasattr(p, "ds_id")]
    with deepspeed.zero.GatheredParameters(zero):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "buffers": buffers(model), "free": all(released(p) for p in zero)}


def _save_tiny(path: str, drop: tuple[str, ...]) -> None:
    from safetensors.torch import load_file, save_file

    from tests.hf_tiny import save_reference
    save_reference(path)
    if drop:  # missing keys: transformers 5.24 gathers list({not-initialized params AND buffers}) with mr=0
        file = f"{path}/model.safetensors"
        sd = {k: v for k, v in load_file(file).items() if k not in drop}
        save_file(sd, file, metadata={"format": "pt"})


def _run_hf(pool, case, path=""):
    out = {}
    for kind in KINDS:
        try:
            out[kind] = pool.run(_hf, kind, case, path, timeout=180)
        except RankFailure as e:
            raise RankFailure(f"[{kind}] {e}") from None
    return out


def test_transformers_resize_token_embeddings(ranks2):
    """GPT-2 (bias-free, untied lm_head): the [Z, None, T, None] modifier_rank=0 call and the body that re-registers
    the gathered weight. Seeds are equal on every rank right before the resize: transformers' mean-resizing samples
    the new rows on each rank into plain (non-ZeRO) tensors, so with per-rank seeds they differ in every kind."""
    out = _run_hf(ranks2, "resize")
    assert_same_params(out)
    for kind, results in out.items():
        for res in results:
            assert same_state(res["params"], results[0]["params"]) and same_state(res["buffers"], results[0]["buffers"])
            for name in ("transformer.wte.weight", "lm_head.weight"):
                assert res["params"][name].shape == (24, 8)
                assert torch.equal(res["params"][name][:20], res["before"]["params"][name]), (kind, name)


def test_transformers_distilbert_sinusoidal_from_config_does_not_hang(ranks2):
    out = _run_hf(ranks2, "distilbert")
    assert_same_params(out)
    for kind, results in out.items():
        for res in results:
            pos = res["params"]["embeddings.position_embeddings.weight"]
            assert torch.equal(pos, results[0]["params"]["embeddings.position_embeddings.weight"]), kind
            assert torch.equal(pos[0, 0::2], torch.zeros(4)) and torch.equal(pos[0, 1::2], torch.ones(4)), kind


@pytest.mark.parametrize("drop", [(), ("lin.weight", "bn.running_mean")], ids=["full", "missing-keys"])
def test_transformers_from_pretrained(ranks2, tmp_path, drop):
    """5.24 _initialize_missing_keys: GatheredParameters(list(set(...)), modifier_rank=0) on every rank, empty for a
    full checkpoint, [ZeRO params + buffers] in a per-rank order otherwise."""
    path = str(tmp_path)
    _save_tiny(path, drop)
    out = _run_hf(ranks2, "pretrained", path)
    if not HF5:  # transformers 4.x leaves missing parameters uninitialised under ZeRO-3 (memory garbage, any kind)
        for results in out.values():
            for res in results:
                res["params"] = {k: v for k, v in res["params"].items() if k not in drop}
    assert_same_params(out, "params")
    ref = out["deepspeed"][0]
    for kind, results in out.items():
        for rank, res in enumerate(results):
            assert res["free"]
            persistent = {k: v for k, v in res["buffers"].items() if k != "noise"}
            # transformers 5 broadcasts checkpoint buffers itself; 4.x loads them on rank 0 only, inside a
            # GatheredParameters(module's own parameters, modifier_rank=0) per module: install() and ours (whose
            # parameter lists commit their owners' buffers) fix it
            agree = HF5 or kind in ("installed", "ours") or rank == 0
            assert same_state(persistent, {k: ref["buffers"][k] for k in persistent}) == agree, (kind, rank)
            if not drop and agree:
                assert persistent["bn.running_mean"].tolist() == list(range(8))
            # the non-persistent buffer (initialised per rank by _init_weights) only agrees under install()
            assert torch.equal(res["buffers"]["noise"], results[0]["buffers"]["noise"]) == \
                (kind == "installed" or res is results[0]), kind
