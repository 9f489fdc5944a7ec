"""router_bias on a tiny transformers DeepSeek-V3 under DeepSpeed ZeRO-3 and FSDP2, against a float64 single-process
run on the global batch: the biases match, are bitwise equal on every rank, checkpointing counts each micro-batch
once, eval forwards count nothing."""
from __future__ import annotations

import pickle
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero_buffers as zb

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
              first_k_dense_replace=0, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
              num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
              qk_nope_head_dim=8, v_head_dim=8, initializer_range=0.5)
STEPS, GAMMA, LR, SEQ = 4, 0.01, 0.05, 8
_EVAL = True
GATES = ("model.layers.0.mlp.gate", "model.layers.1.mlp.gate")


def _model() -> nn.Module:
    """The same tiny DeepseekV3ForCausalLM on every rank (a PreTrainedModel: post_init initialises the experts)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(**CONFIG)
    config._attn_implementation = "eager"
    if hasattr(config, "_experts_implementation"):  # transformers 5: the default grouped_mm takes no float64
        config._experts_implementation = "eager"
    return DeepseekV3ForCausalLM(config).train()


def _batch(rank: int, step: int) -> torch.Tensor:
    """Each rank's tokens come from its own eighth of the vocabulary: its preferred experts differ."""
    g = torch.Generator().manual_seed(100 * step + rank)
    lo = (rank * 8) % 64
    return torch.randint(lo, lo + 8, (2, SEQ), generator=g)


def _bias(module: nn.Module, name: str) -> torch.Tensor:
    return module.get_submodule(name).e_score_correction_bias


def reference(world: int, rule: str = "sign") -> dict:
    """Single process, float64 (transformers 4.x: float32): the model on every rank's batch at once, plain SGD on
    the global mean loss, the update from the global counts."""
    import transformers

    # transformers 4.x's DeepSeek-V3 MoE routes in fp32 and index_adds into an fp32 buffer: it cannot run in float64
    dtype = torch.float64 if int(transformers.__version__.split(".")[0]) >= 5 else torch.float32
    model = _model().to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    counts = {n: torch.zeros(8, dtype=torch.int64) for n in GATES}
    def count(name: str, out: tuple) -> None:  # the integer output: (logits, weights, indices) or (indices, weights)
        ids, = [t for t in out if not t.is_floating_point()]
        counts[name].add_(torch.bincount(ids.reshape(-1), minlength=8))
    for n in GATES:
        model.get_submodule(n).register_forward_hook(lambda m, a, out, n=n: count(n, out))
    loads = []
    for step in range(STEPS):
        ids = torch.cat([_batch(r, step) for r in range(world)])
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        loads.append({n: c.clone() for n, c in counts.items()})
        with torch.no_grad():
            for n in GATES:
                load = counts[n].double()
                mean = load.mean()
                d = torch.sign(mean - load) if rule == "sign" else (mean - load) / mean
                _bias(model, n).copy_(_bias(model, n).double() + GAMMA * d)
                counts[n].zero_()
    return {"bias": {n: _bias(model, n).clone() for n in GATES}, "loads": loads}


def _train(rank: int, world: int, kind: str, checkpointing: bool | None, rule: str = "sign",
           kis: bool = False) -> dict:
    """STEPS optimizer steps under ``kind`` ("zero3" or "fsdp2"); an eval forward before every step must change
    nothing. Returns the biases (fp32, as held), the global loads of each update and what the eval forwards did."""
    if kind == "zero3":
        from tests.helpers import init_deepspeed
        deepspeed = init_deepspeed()
    model = _model()
    kept = None
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    if kind == "zero3":
        # ranks route to different experts: DeepSpeed's documented recipe for MoE blocks under ZeRO-3 (gather the
        # block's parameters as one leaf, else each rank's trace visits other modules)
        deepspeed.utils.set_z3_leaf_modules(model, [type(model.model.layers[0].mlp)])
        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
                  "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}
        engine, *_ = deepspeed.initialize(model=model, config=config,
                                          optimizer=torch.optim.SGD(model.parameters(), lr=LR))
        handle = zb.router_bias(engine, gamma=GAMMA, rule=rule)

        def step(ids: torch.Tensor) -> None:
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        module = engine.module
    else:
        from torch.distributed.fsdp import fully_shard
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        handle = zb.router_bias(model, gamma=GAMMA, rule=rule, optimizer=opt)
        kept = zb.keep_in_sync(model) if kis else None  # syncs before train forwards: the router does not ride

        def step(ids: torch.Tensor) -> None:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        module = model
    loads, eval_changed = [], []
    for s in range(STEPS):
        before = ({n: b.clone() for n, b in handle.counts().items()},
                  {n: _bias(module, n).clone() for n in GATES})
        if _EVAL:
            module.eval()
            with torch.no_grad():
                module(input_ids=_batch(rank, 1000 + s))
            module.train()
        eval_changed.append(any(not torch.equal(before[0][n], c) for n, c in handle.counts().items()) or
                            any(not torch.equal(before[1][n], _bias(module, n)) for n in GATES))
        step(_batch(rank, s))
        loads.append({n: c.clone() for n, c in handle.last_load.items()})
    rode = handle.riding is not None
    handle.remove()
    if kept is not None:
        kept.remove()
    dtypes = {n: _bias(module, n).dtype for n in GATES}
    return {"bias": {n: _bias(module, n).detach().clone() for n in GATES}, "loads": loads, "eval": eval_changed,
            "dtypes": dtypes, "updates": handle.updates, "rode": rode}


def _check(out: list[dict], ref: dict) -> None:
    for rank, o in enumerate(out):
        assert o["updates"] == STEPS, (rank, o["updates"])
        assert not any(o["eval"]), f"rank {rank}: an eval forward changed the counts or a bias: {o['eval']}"
        assert all(d == torch.float32 for d in o["dtypes"].values()), (rank, o["dtypes"])
        for s, (got, want) in enumerate(zip(o["loads"], ref["loads"])):
            for n in GATES:
                assert torch.equal(got[n], want[n]), f"rank {rank} step {s} {n}: load {got[n]} != reference {want[n]}"
        for n in GATES:
            err = float((o["bias"][n].double() - ref["bias"][n]).abs().max())
            assert err < 1e-6, f"rank {rank} {n}: bias differs from the float64 reference by {err}"
            assert torch.equal(o["bias"][n], out[0]["bias"][n]), f"rank {rank} {n}: bias differs from rank 0's"
    assert any(float(b.abs().max()) > 0 for b in ref["bias"].values())  # the biases moved


@pytest.mark.stack
def test_zero3_router_bias_equals_the_float64_global_batch_reference_and_is_bitwise_equal_on_every_rank(ranks):
    out = ranks.run(_train, "zero3", None, timeout=300)
    _check(out, reference(ranks.world_size))


@pytest.mark.stack
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_zero3_gradient_checkpointing_counts_each_micro_batch_once(ranks2, reentrant):
    out = ranks2.run(_train, "zero3", reentrant, timeout=300)
    _check(out, reference(2))  # the loads of every update equal the reference's, which never checkpoints


def test_fsdp2_router_bias_equals_the_float64_global_batch_reference_and_is_bitwise_equal_on_every_rank(ranks):
    out = ranks.run(_train, "fsdp2", None, "proportional", timeout=300)
    _check(out, reference(ranks.world_size, "proportional"))


def test_fsdp2_with_keep_in_sync_the_router_keeps_its_own_transaction_and_stays_exact(ranks2):
    out = ranks2.run(_train, "fsdp2", None, "sign", True, timeout=300)
    _check(out, reference(2))
    assert not any(o["rode"] for o in out)  # keep_in_sync ticks on forwards, the router on optimizer steps


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_fsdp2_gradient_checkpointing_counts_each_micro_batch_once(ranks2, reentrant):
    out = ranks2.run(_train, "fsdp2", reentrant, timeout=300)
    _check(out, reference(2))


# -- one process: arguments, adapters, 16-bit buffers, the model's own API -----------------------------------------
@pytest.mark.stack
def test_bad_arguments_and_a_model_without_gates_raise_before_anything_is_installed():
    model = _model()
    for kwargs in ({"gamma": 0}, {"gamma": True}, {"rule": "linear"}, {"every": 0}, {"optimizer": object()}):
        with pytest.raises(zb.InvalidArgumentError):
            zb.router_bias(model, **kwargs)
    with pytest.raises(zb.InvalidArgumentError, match="no MoE gate"):
        zb.router_bias(nn.Linear(2, 2))
    with zb.router_bias(model), pytest.raises(zb.InvalidArgumentError, match="already counted"):
        zb.router_bias(model)
    assert not any(h for m in model.modules() for h in m._forward_hooks.values())


class _Router(nn.Module):
    """A router of another shape: returns a dict, holds its bias as ``expert_bias``."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 6)
        self.register_buffer("expert_bias", torch.zeros(6))

    def forward(self, x):
        return {"ids": (self.proj(x) + self.expert_bias).topk(2, dim=-1).indices}


def test_a_registered_router_class_is_counted_by_its_adapter_and_checkpoint_recompute_is_not():
    from torch.utils.checkpoint import checkpoint

    zb.register_gate(_Router, indices=lambda gate, inputs, output: output["ids"], bias="expert_bias")
    torch.manual_seed(0)
    router = _Router()
    x = torch.randn(10, 4, requires_grad=True)
    with zb.router_bias(router, gamma=0.5) as handle:
        for reentrant in (True, False):
            checkpoint(lambda t: router(t)["ids"].float().mul(t.sum()), x, use_reentrant=reentrant).sum().backward()
        want = torch.bincount(router(x)["ids"].reshape(-1), minlength=6) * 3  # three train forwards counted
        assert torch.equal(handle.counts()[""], want)
        handle.update()
    assert torch.equal(router.expert_bias, 0.5 * torch.sign(want.double().mean() - want.double()).float())


def test_a_family_the_default_adapter_cannot_read_raises_naming_register_gate():
    class Statics(nn.Module):  # like Ernie 4.5's MoeStatics: holds the bias, returns floats
        def __init__(self):
            super().__init__()
            self.register_buffer("e_score_correction_bias", torch.zeros(4))

        def forward(self, x):
            return x + self.e_score_correction_bias

    statics = Statics()
    zb.router_bias(statics)
    with pytest.raises(zb.InvalidArgumentError, match="register_gate"):
        statics(torch.zeros(2, 4))


@pytest.mark.stack
def test_a_bf16_bias_is_updated_from_an_fp32_copy_and_the_model_still_generates_saves_and_pickles(tmp_path):
    model = _model().bfloat16()
    with torch.no_grad():
        for n in GATES:
            _bias(model, n).fill_(5.0)  # bf16 spacing at 5 is 0.03: steps of 1e-3 vanish in 16-bit arithmetic
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = zb.router_bias(model, gamma=1e-3)
    assert any("16 bits" in str(w.message) for w in caught)
    ids = _batch(0, 0)
    for _ in range(20):
        model(input_ids=ids)
        handle.step()
    master = {g.name: g.master for g in handle.gates}
    for n in GATES:  # 20 steps of +-1e-3 moved the fp32 copy; the buffer holds its rounding
        assert master[n] is not None and master[n].dtype == torch.float32
        assert float((master[n] - 5).abs().max()) > 5e-3
        assert torch.equal(_bias(model, n), master[n].bfloat16())
    model.eval()
    out = model.generate(ids[:1, :4], max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 7)
    model.save_pretrained(tmp_path)
    assert pickle.loads(pickle.dumps(model)).dtype == torch.bfloat16
    handle.remove()
    assert dist.is_available()


def _zero3_engine(accumulation: int = 1, counter: bool = False):
    """The tiny model on a ZeRO-3 engine; ``counter``: with an int64 buffer ``model.tokens_seen`` of its own."""
    from tests.helpers import init_deepspeed
    deepspeed = init_deepspeed()
    model = _model()
    if counter:
        model.model.register_buffer("tokens_seen", torch.zeros((), dtype=torch.int64), persistent=False)
    deepspeed.utils.set_z3_leaf_modules(model, [type(model.model.layers[0].mlp)])
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}, "gradient_clipping": 0.0,
              "zero_allow_untested_optimizer": True, "gradient_accumulation_steps": accumulation}
    engine, *_ = deepspeed.initialize(model=model, config=config, optimizer=torch.optim.SGD(model.parameters(), lr=LR))
    return engine


def _riding_fault(rank, world):
    """Riding, a failure on rank 1 while keep_in_sync packs at step 2: every rank raises, no bias moves; step 3's
    update uses every rank's counts of steps 2 and 3 (``local``: this rank's before each engine.step)."""
    from zero_buffers._core import transaction
    engine = _zero3_engine()
    kept = zb.keep_in_sync(engine)
    handle = zb.router_bias(engine, gamma=GAMMA)
    module, loads, local, raised = engine.module, [], [], None
    for s in range(4):
        ids = _batch(rank, s)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        before = {n: _bias(module, n).clone() for n in GATES}
        local.append(handle.counts())
        real = transaction.reached
        if s == 2 and rank == 1:
            def failing(phase, what):
                if phase == transaction.Phase.PREPARE:
                    raise RuntimeError("injected")
            transaction.reached = failing
        try:
            engine.step()
        except zb.SyncAbortedError as e:
            raised = (s, str(e))
            assert all(torch.equal(before[n], _bias(module, n)) for n in GATES)
        finally:
            transaction.reached = real
        loads.append({n: c.clone() for n, c in handle.last_load.items()})
    handle.remove()
    kept.remove()
    return {"raised": raised, "loads": loads, "updates": handle.updates, "local": local,
            "bias": {n: _bias(module, n).detach().clone() for n in GATES}}


@pytest.mark.stack
def test_riding_a_failure_on_one_rank_raises_on_every_rank_and_the_counts_carry_over(ranks2):
    out = ranks2.run(_riding_fault, timeout=300)
    for o in out:
        assert o["raised"] is not None and o["raised"][0] == 2, o["raised"]
        assert o["updates"] == 3  # the failed step updated nothing
        for n in GATES:
            want = sum(p["local"][3][n] for p in out)  # both steps of both ranks, counted once
            assert int(want.sum()) == 2 * 2 * 2 * SEQ * 2 and torch.equal(o["loads"][3][n], want), (n, o["loads"])
            assert torch.equal(o["bias"][n], out[0]["bias"][n])


class _Log(list):
    """The collectives of zero_buffers' callbacks only: paused while DeepSpeed's own step runs."""

    paused = False

    def append(self, item):
        if not self.paused:
            super().append(item)


def _riding(rank, world, order, kis_every, counter=False):
    """STEPS ZeRO-3 steps with keep_in_sync and router_bias on one engine (made in ``order``), the collectives of each
    engine.step() besides DeepSpeed's own logged; then the router removed, keep_in_sync's alone. Returns what _check
    takes, the logs and the steady log of keep_in_sync alone. ``counter``: the model holds an int64 counter of its
    own that keep_in_sync sums."""
    from tests.helpers import log_collectives, restore_collectives
    engine = _zero3_engine(counter=counter)
    rules = {"model.tokens_seen": "sum"} if counter else {}
    log = _Log()
    deepspeed_step = engine.step

    def quiet(*args, **kwargs):  # the innermost step: DeepSpeed's, not logged
        log.paused = True
        try:
            return deepspeed_step(*args, **kwargs)
        finally:
            log.paused = False
    object.__setattr__(engine, "step", quiet)
    if order == "kis_first":
        kept = zb.keep_in_sync(engine, every=kis_every, rules=rules)
        handle = zb.router_bias(engine, gamma=GAMMA)
    else:
        handle = zb.router_bias(engine, gamma=GAMMA)
        kept = zb.keep_in_sync(engine, every=kis_every, rules=rules)
    rode = handle.riding is kept
    module = engine.module

    def step(ids):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        del log[:]
        real = log_collectives(log)
        try:
            engine.step()
        finally:
            restore_collectives(real)
        return list(log)
    logs, loads = [], []
    for s in range(STEPS):
        logs.append(step(_batch(rank, s)))
        loads.append({n: c.clone() for n, c in handle.last_load.items()})
    out = {"bias": {n: _bias(module, n).detach().clone() for n in GATES}, "loads": loads, "eval": [False],
           "dtypes": {n: _bias(module, n).dtype for n in GATES}, "updates": handle.updates, "rode": rode,
           "logs": logs, "state_dict": sorted(module.state_dict())}
    if order == "kis_first":
        handle.remove()  # keep_in_sync carries on alone (it agrees again at its next sync)
    else:
        kept.remove()  # the router carries on alone, with its own transaction
        out["own"] = [step(_batch(rank, STEPS + s)) for s in range(2)]
        out["own_updates"] = handle.updates
        handle.remove()
        kept = zb.keep_in_sync(engine, every=kis_every, rules=rules)
    alone = [step(_batch(rank, STEPS + 2 + s)) for s in range(2 * kis_every)]
    kept.remove()
    out["alone"] = alone[-kis_every:]
    return out


_COUNTS = ("all_reduce", "torch.int64", 16)  # both gates' tokens per expert, one int64 bucket


@pytest.mark.stack
@pytest.mark.parametrize("order", ["kis_first", "router_first"])
def test_with_keep_in_sync_the_counts_ride_in_its_sync_and_the_bias_equals_the_float64_reference(ranks, order):
    """keep_in_sync and router_bias on one ZeRO-3 engine, made in either order: every step costs keep_in_sync's
    collectives and the counts' int64 bucket, none of the router's own transaction (its agreement, vote), and the
    biases still equal the float64 global-batch reference, bitwise equal on every rank."""
    out = ranks.run(_riding, order, 1, timeout=300)
    _check(out, reference(ranks.world_size))
    for o in out:
        assert o["rode"], "router_bias did not ride in keep_in_sync's sync"
        alone = o["alone"][-1]
        assert alone and all(c[0] in ("broadcast", "all_reduce") for c in alone), alone  # the steady sync
        for s, got in enumerate(o["logs"][1:], 1):  # step 0 is keep_in_sync's first sync: the agreement
            assert sorted(got) == sorted([*alone, _COUNTS]), (s, got, alone)
        assert not any(n.endswith("[tokens_per_expert]") for n in o["state_dict"]), o["state_dict"]
        if order == "router_first":  # keep_in_sync removed: the router's own transaction again, every step
            assert o["own_updates"] == STEPS + 2
            assert [c[0] for c in o["own"][-1]] == ["all_gather", "all_reduce", "all_gather"], o["own"]


@pytest.mark.stack
def test_with_an_int64_sum_buffer_of_the_model_the_counts_share_its_bucket_and_add_no_collective(ranks2):
    out = ranks2.run(_riding, "kis_first", 1, True, timeout=300)
    _check(out, reference(2))
    for o in out:
        alone = o["alone"][-1]
        assert ("all_reduce", "torch.int64", 1) in alone, alone  # keep_in_sync alone sums the counter
        want = [("all_reduce", "torch.int64", 1 + 16) if c == ("all_reduce", "torch.int64", 1) else c for c in alone]
        for s, got in enumerate(o["logs"][1:], 1):
            assert len(got) == len(alone) and sorted(got) == sorted(want), (s, got, alone)


@pytest.mark.stack
def test_when_keep_in_sync_syncs_every_other_step_the_router_sums_its_own_steps_and_stays_exact(ranks2):
    out = ranks2.run(_riding, "kis_first", 2, timeout=300)
    _check(out, reference(2))
    for o in out:
        assert o["rode"]
        alone = o["alone"]
        assert alone[0] == [] and alone[1], alone  # keep_in_sync alone: a sync every other step
        for s, got in enumerate(o["logs"][2:], 2):
            if s % 2:  # keep_in_sync syncs: the counts ride along
                assert sorted(got) == sorted([*alone[1], _COUNTS]), (s, got)
            else:  # keep_in_sync does not sync: the router's own transaction (agreement, sum, vote)
                assert [c[0] for c in got] == ["all_gather", "all_reduce", "all_gather"], (s, got)


def _engine_with_keep_in_sync(rank, world):
    engine = _zero3_engine(accumulation=2)
    kept = zb.keep_in_sync(engine)
    handle = zb.router_bias(engine, gamma=GAMMA)  # wraps keep_in_sync's engine.step in turn
    for s in range(4):  # 4 micro-batches, 2 optimizer steps
        ids = _batch(rank, s)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    try:
        kept.remove()  # not the outermost wrapper: refused, nothing removed
        refused = False
    except zb.InvalidArgumentError:
        refused = True
    rode = handle.riding is kept
    handle.remove()
    kept.remove()
    return {"syncs": kept.syncs, "updates": handle.updates, "refused": refused, "restored": "step" not in vars(engine),
            "load": int(handle.last_load[GATES[0]].sum()), "rode": rode}


@pytest.mark.stack
def test_router_bias_and_keep_in_sync_on_one_engine_each_run_once_per_optimizer_step(ranks2):
    out = ranks2.run(_engine_with_keep_in_sync, timeout=300)
    for o in out:
        assert o == {"syncs": 2, "updates": 2, "refused": True, "restored": True, "rode": True,
                     "load": 2 * 2 * 2 * SEQ * 2}, o  # ranks x micro-batches x batch x tokens x top-2
