"""frozen_replica: a frozen module as a full, identical, no_grad replica on every rank that keeps the wrapped model's
API: real transformers / diffusers / remote-code models, 2 and 4 gloo ranks; and on real DeepSpeed ZeRO-3 ranks
(section 8), built partitioned or plain, through deepspeed.initialize, training and checkpoints.

Every rank builds its model with its own seed (other weights and buffers), so a check that passes shows both the
broadcast from rank 0 and the API. The reference ("the original") is rank 0's model built again, locally, from
the same seed: builds are deterministic, so its outputs are what rank 0's model gave before frozen_replica.

Each rank body returns {check: True or a message}; the parent asserts every value is True and prints the others.
"""
# ruff: noqa: B023 - the check lambdas run at once, inside the loop iteration that made them
from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import pickle
import threading

import pytest
import torch
from torch import nn

import zero_buffers as zb
from tests.helpers import (
    ZERO3_CONFIG,
    bitwise_equal,
    buffers,
    init_deepspeed,
    log_collectives,
    log_deepspeed_comm,
    restore_collectives,
    same_state,
)
from tests.zero3.models import Tokenizer

# the tests of what DeepSpeed, transformers and Accelerate do: run on both dependency stacks (.ci/run)
pytestmark = pytest.mark.stack

# ------------------------------------------------------------------------------------------------ tiny models
@contextlib.contextmanager
def _seeded(seed: int):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def tiny_bert(seed: int) -> nn.Module:
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=16, pad_token_id=0)
    with _seeded(seed):
        return BertModel(cfg).eval()


def _clip_configs():
    from transformers import CLIPTextConfig, CLIPVisionConfig

    text = CLIPTextConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, max_position_embeddings=16, projection_dim=8,
                          bos_token_id=0, eos_token_id=1, pad_token_id=1)
    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                              image_size=16, patch_size=8, projection_dim=8)
    return text, vision


def tiny_clip(seed: int) -> nn.Module:
    from transformers import CLIPConfig, CLIPModel

    text, vision = _clip_configs()
    with _seeded(seed):
        return CLIPModel(CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                    projection_dim=8)).eval()


def tiny_clip_text(seed: int) -> nn.Module:
    from transformers import CLIPTextModel

    with _seeded(seed):
        return CLIPTextModel(_clip_configs()[0]).eval()


def tiny_gpt2(seed: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32, bos_token_id=0, eos_token_id=1)
    with _seeded(seed):
        return GPT2LMHeadModel(cfg).eval()


def tiny_llama(seed: int) -> nn.Module:
    from tests.corpus import build_llama

    return build_llama(seed).eval()


def tiny_remote(seed: int) -> nn.Module:
    """The corpus' custom-code model, loaded with AutoModel.from_pretrained(trust_remote_code=True)."""
    from tests.corpus import build_remote_tiny_vq

    return build_remote_tiny_vq(seed).eval()


BUILDERS = {"bert": tiny_bert, "clip": tiny_clip, "clip_text": tiny_clip_text, "gpt2": tiny_gpt2,
            "llama": tiny_llama, "remote": tiny_remote}


def _ids(seed: int = 0, batch: int = 2, length: int = 6) -> torch.Tensor:
    return torch.randint(2, 64, (batch, length), generator=torch.Generator().manual_seed(seed))


def _pixels(seed: int = 0) -> torch.Tensor:
    return torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def _video(seed: int = 0) -> torch.Tensor:
    return torch.randn(2, 3, 2, 8, 8, generator=torch.Generator().manual_seed(seed))


def _main(out):
    """The tensor a caller uses: the tensor itself, pooled features, logits, last hidden state or reconstruction."""
    if isinstance(out, torch.Tensor):
        return out
    for key in ("pooler_output", "logits", "reconstruction", "last_hidden_state"):
        value = getattr(out, key, None)
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError(type(out).__name__)


# ------------------------------------------------------------------------------------------------ check helpers
def _check(results: dict, name: str, fn) -> None:
    """results[name] = True, or why not (a failed comparison's message, or the exception)."""
    try:
        value = fn()
        results[name] = True if value is True else (value if isinstance(value, str) else f"returned {value!r}")
    except Exception as e:
        results[name] = f"{type(e).__name__}: {e}"


def _equal(a: torch.Tensor, b: torch.Tensor, what: str = "output") -> bool | str:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return f"{what}: not tensors ({type(a).__name__}, {type(b).__name__})"
    return True if bitwise_equal(a.detach(), b.detach()) else f"{what} differs from the original's"


def _same_state(a: dict, b: dict, what: str = "state_dict") -> bool | str:
    if list(a) != list(b):
        return f"{what}: keys differ: {sorted(set(a) ^ set(b))[:5]} (or their order)"
    bad = [k for k in a if not bitwise_equal(a[k].detach(), b[k].detach())]
    return True if not bad else f"{what}: {len(bad)} tensors differ, e.g. {bad[:3]}"


def _everything(m: nn.Module) -> dict[str, torch.Tensor]:
    """state_dict plus the non-persistent buffers."""
    out = dict(m.state_dict())
    for k, v in m.named_buffers():
        out.setdefault(k, v)
    return out


def real_parameters(m: nn.Module) -> int:
    """nn.Parameters left in the module tree (``bias=False`` layers keep a ``None`` entry in ``_parameters``: that
    is how torch spells "no bias", not a parameter, so it is not counted)."""
    return sum(p is not None for x in m.modules() for p in x._parameters.values())


def _no_grad_result(out: torch.Tensor) -> bool | str:
    return True if not out.requires_grad and out.grad_fn is None else "output is tracked by autograd"


def _assert_all(out: list, label: str = "") -> None:
    bad = {r: {k: v for k, v in checks.items() if v is not True} for r, checks in enumerate(out)}
    bad = {r: v for r, v in bad.items() if v}
    assert not bad, f"{label} failed checks by rank: {bad}"


def _flat(prefix: str, checks: dict) -> dict:
    return {f"{prefix}.{k}": v for k, v in checks.items()}


# ---------------------------------------------------------------------------- 1. attributes, own methods, no_grad
def _common(results: dict, replica: nn.Module, ref: nn.Module) -> None:
    """What every replica must answer like its original does."""
    _check(results, "is_replica", lambda: zb.is_frozen_replica(replica) or "not a replica")
    _check(results, "class_names", lambda: [type(m).__name__ for m in replica.modules()]
           == [type(m).__name__ for m in ref.modules()] or "class names differ")
    _check(results, "no_real_parameters", lambda: real_parameters(replica) == 0 or "nn.Parameters left")
    _check(results, "dtype", lambda: replica.dtype == torch.float32 or f"dtype {replica.dtype}")
    _check(results, "device", lambda: replica.device == torch.device("cpu") or f"device {replica.device}")

    def first():
        p = next(iter(replica.parameters()))
        if type(p) is not torch.Tensor or hasattr(p, "ds_id") or p.requires_grad:
            return f"first weight is {type(p).__name__}, requires_grad={p.requires_grad}"
        return _equal(p, next(iter(ref.parameters())), "first weight")
    _check(results, "next_parameters", first)
    _check(results, "parameter_names", lambda: [n for n, _ in replica.named_parameters()]
           == [n for n, _ in ref.named_parameters()] or "named_parameters() names differ")
    _check(results, "num_parameters", lambda: replica.num_parameters() == ref.num_parameters()
           or f"num_parameters {replica.num_parameters()} != {ref.num_parameters()}")
    _check(results, "state", lambda: _same_state(_everything(replica), _everything(ref)))
    _check(results, "eval_under_train", lambda: (replica.train(), list(replica.modules())[-1].train(),
                                                  not any(m.training for m in replica.modules()))[-1]
           or "a module is in train mode")

    def refuses_grad():
        try:
            replica.requires_grad_(True)
        except zb.InvalidArgumentError:
            return not any(t.requires_grad for t in replica.parameters()) or "a weight requires grad"
        return "requires_grad_(True) did not raise"
    _check(results, "requires_grad_raises", refuses_grad)


def _model_checks(name: str, replica: nn.Module, ref: nn.Module) -> dict:
    results: dict = {}
    _common(results, replica, ref)
    if name == "bert":
        ids = _ids()
        _check(results, "forward", lambda: _equal(replica(input_ids=ids).last_hidden_state,
                                                  ref(input_ids=ids).last_hidden_state))
        emb = ref.get_input_embeddings()(ids).detach().requires_grad_()
        _check(results, "forward_no_grad", lambda: _no_grad_result(replica(inputs_embeds=emb).last_hidden_state))
        _check(results, "control_tracked", lambda: ref(inputs_embeds=emb).last_hidden_state.requires_grad
               or "the original's output was not tracked either")
        _check(results, "get_input_embeddings", lambda: replica.get_input_embeddings().weight
               is replica.embeddings.word_embeddings.weight or "another tensor")
    elif name == "clip":
        ids = _ids()
        _check(results, "get_text_features", lambda: _equal(_main(replica.get_text_features(input_ids=ids)),
                                                            _main(ref.get_text_features(input_ids=ids))))

        def processor():  # what image processors / pipelines do with a model
            pixels = _pixels().to(replica.device, replica.dtype)
            return _equal(_main(replica.get_image_features(pixel_values=pixels)),
                          _main(ref.get_image_features(pixel_values=_pixels())))
        _check(results, "processor_to_device_dtype", processor)
        if hasattr(ref.text_model, "dtype"):  # transformers 5 (in 4.57 the inner transformers are plain modules)
            _check(results, "inner_dtype", lambda: (replica.text_model.dtype, replica.vision_model.device)
                   == (torch.float32, torch.device("cpu")) or "inner modules' dtype/device")
        pixels = _pixels().requires_grad_()
        _check(results, "get_image_features_no_grad",
               lambda: _no_grad_result(_main(replica.get_image_features(pixel_values=pixels))))
        _check(results, "forward_no_grad", lambda: _no_grad_result(
            replica(input_ids=ids, pixel_values=pixels).logits_per_image))
        _check(results, "control_tracked", lambda: _main(ref.get_image_features(pixel_values=pixels)).requires_grad
               or "the original's output was not tracked either")
    elif name == "clip_text":
        ids = _ids()
        _check(results, "forward", lambda: _equal(replica(input_ids=ids).pooler_output,
                                                  ref(input_ids=ids).pooler_output))
        _check(results, "ids_to_device", lambda: _equal(replica(input_ids=ids.to(replica.device)).last_hidden_state,
                                                        ref(input_ids=ids).last_hidden_state))
    elif name in ("gpt2", "llama"):
        ids = _ids(length=4)
        kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        _check(results, "can_generate", lambda: replica.can_generate() or "can_generate() is False")
        _check(results, "generate", lambda: _equal(replica.generate(ids, **kw), ref.generate(ids, **kw), "generate"))
        _check(results, "forward", lambda: _equal(replica(input_ids=ids).logits, ref(input_ids=ids).logits))
        emb = ref.get_input_embeddings()(ids).detach().requires_grad_()
        _check(results, "forward_no_grad", lambda: _no_grad_result(replica(inputs_embeds=emb).logits))
        if name == "gpt2":
            _check(results, "tied", lambda: replica.lm_head.weight is replica.transformer.wte.weight or "untied")
    elif name == "remote":
        video = _video()
        _check(results, "encode", lambda: _equal(replica.encode(video), ref.encode(video), "encode"))
        _check(results, "decode", lambda: _equal(replica.decode(ref.encode(video)), ref.decode(ref.encode(video)),
                                                 "decode"))
        _check(results, "forward", lambda: _equal(replica(video).reconstruction, ref(video).reconstruction))
        tracked = video.clone().requires_grad_()
        _check(results, "forward_no_grad", lambda: _no_grad_result(replica(tracked).reconstruction))
        _check(results, "control_tracked", lambda: ref(tracked).reconstruction.requires_grad
               or "the original's output was not tracked either")
    return results


def _api(rank, world):
    results: dict = {}
    for name, build in BUILDERS.items():
        ref = build(0)  # rank 0's model, as it was before frozen_replica
        replica = zb.frozen_replica(build(rank))
        results.update(_flat(name, _model_checks(name, replica, ref)))
    return results


def test_transformers_models_keep_their_api(ranks2):
    """.dtype, .device, next(parameters()), processor code, the model's own methods (same results as the
    original, under no_grad), generate, eval mode, requires_grad_(True) refused."""
    _assert_all(ranks2.run(_api, timeout=240))


def _grad_flows(rank, world):
    """no_grad=False: gradients reach the input (perceptual losses, guidance), never the weights."""
    results: dict = {}
    ref = tiny_bert(0)
    replica = zb.frozen_replica(tiny_bert(rank), no_grad=False)
    ids = _ids()
    x = ref.get_input_embeddings()(ids).detach().requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    replica(inputs_embeds=x).last_hidden_state.pow(2).sum().backward()
    ref(inputs_embeds=x_ref).last_hidden_state.pow(2).sum().backward()
    _check(results, "bert.input_grad", lambda: x.grad is not None and x.grad.abs().sum() > 0
           and _equal(x.grad, x_ref.grad, "input gradient"))
    _check(results, "bert.weights_no_grad", lambda: all(t.grad is None and not t.requires_grad
                                                        for t in replica.parameters()) or "a weight got a gradient")
    _check(results, "bert.frozen", lambda: (zb.is_frozen_replica(replica) and not replica.training) or "not frozen")

    ref = tiny_remote(0)
    replica = zb.frozen_replica(tiny_remote(rank), no_grad=False)
    v, v_ref = _video().requires_grad_(), _video().requires_grad_()
    replica(v).reconstruction.sum().backward()
    ref(v_ref).reconstruction.sum().backward()
    _check(results, "remote.input_grad", lambda: v.grad is not None and _equal(v.grad, v_ref.grad, "input gradient"))
    _check(results, "remote.weights_no_grad", lambda: all(t.grad is None for t in replica.parameters())
           or "a weight got a gradient")
    return results


def test_no_grad_false_lets_gradients_reach_the_input(ranks2):
    _assert_all(ranks2.run(_grad_flows, timeout=120))


# ------------------------------------------------------------------------------------ 2. save_pretrained round trip
def _pretrained(rank, world, tmp):
    from transformers import BertModel, CLIPModel, GPT2LMHeadModel

    from tests.corpus import load_remote_model, save_on_every_rank

    results: dict = {}
    folder = os.path.join(tmp, f"rank{rank}")
    for name, cls in (("bert", BertModel), ("clip", CLIPModel), ("gpt2", GPT2LMHeadModel), ("remote", None)):
        ref = BUILDERS[name](0)
        replica = zb.frozen_replica(BUILDERS[name](rank))
        path = os.path.join(folder, name)
        r: dict = {}

        def save():
            with save_on_every_rank(replica):  # transformers 5 writes nothing on ranks != 0 otherwise
                replica.save_pretrained(path)
            return True
        _check(r, "save", save)
        if r["save"] is not True:
            results.update(_flat(name, r))
            continue
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        original = cls.__name__ if cls is not None else type(ref).__name__
        _check(r, "architectures", lambda: config.get("architectures") == [original]
               or f"architectures = {config.get('architectures')}")
        if cls is None:  # remote code: auto_map names the original class, the code is copied next to the weights
            _check(r, "auto_map", lambda: config.get("auto_map", {}).get("AutoModel")
                   == f"modeling_tiny_vq.{original}" or f"auto_map = {config.get('auto_map')}")
            _check(r, "code_copied", lambda: os.path.exists(os.path.join(path, "modeling_tiny_vq.py"))
                   or "modeling_tiny_vq.py not copied")
            load = lambda: load_remote_model(path)  # noqa: E731 - AutoModel, trust_remote_code=True
        else:
            load = lambda: cls.from_pretrained(path)  # noqa: E731
        holder = {}

        def loads():
            holder["m"] = load()
            m = holder["m"]
            # remote code is imported per folder (transformers_modules.<folder>.<hash>): same class, not same object
            same = (type(m) is type(ref) if cls is not None else
                    (type(m).__qualname__, type(m).__module__.rsplit(".", 1)[-1])
                    == (type(ref).__qualname__, type(ref).__module__.rsplit(".", 1)[-1]))
            if not same or zb.is_frozen_replica(m):
                return f"loaded a {type(m).__module__}.{type(m).__qualname__}, frozen={zb.is_frozen_replica(m)}"
            if real_parameters(m) == 0:
                return "the loaded model has no parameters"
            return _same_state(m.state_dict(), replica.state_dict())
        _check(r, "from_pretrained", loads)
        _check(r, "non_persistent", lambda: _same_state(
            {k: v for k, v in holder["m"].named_buffers() if k not in holder["m"].state_dict()},
            {k: v for k, v in replica.named_buffers() if k not in replica.state_dict()}, "non-persistent buffers"))
        _check(r, "same_as_original", lambda: _same_state(holder["m"].state_dict(), ref.state_dict()))
        results.update(_flat(name, r))
    return results


def test_save_pretrained_writes_a_checkpoint_the_original_class_loads(ranks2, tmp_path):
    """save_pretrained -> ORIGINAL_CLASS.from_pretrained (remote code: AutoModel + trust_remote_code): same keys,
    same values, `architectures` / auto_map name the original class, on every rank."""
    _assert_all(ranks2.run(_pretrained, str(tmp_path), timeout=240))


# ------------------------------------------------------------------------------- 3. torch.save / pickle / deepcopy
class _Locked(nn.Module):
    """A model holding an unpicklable attribute (a lock), as models holding a logger handle or a client do."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.lock = threading.Lock()

    def forward(self, x):
        return self.lin(x)


def _serialisation(rank, world, tmp):
    results: dict = {}
    for name in ("bert", "gpt2", "remote"):
        ref = BUILDERS[name](0)
        replica = zb.frozen_replica(BUILDERS[name](rank))
        before = {k: v.clone() for k, v in _everything(replica).items()}
        r: dict = {}
        path = os.path.join(tmp, f"{name}_rank{rank}.pt")

        def check_copy(copy_: nn.Module) -> bool | str:
            if type(copy_).__name__ != type(ref).__name__ or not zb.is_frozen_replica(copy_):
                return f"a {type(copy_).__name__}, frozen={zb.is_frozen_replica(copy_)}"
            if copy_.dtype != torch.float32 or next(iter(copy_.parameters())) is None:
                return "no dtype / parameters"
            if real_parameters(copy_) != 0:
                return "the copy has nn.Parameters"
            if any(a is b for a, b in zip(copy_.buffers(), replica.buffers())):
                return "the copy shares tensors with the replica"
            if name == "gpt2" and copy_.lm_head.weight is not copy_.transformer.wte.weight:
                return "tied weights were untied"
            ids = _ids()
            example = (dict(pixel_values=_video()) if name == "remote" else dict(input_ids=ids))
            out = _equal(_main(copy_(**example)), _main(ref(**example)))
            if out is not True:
                return out
            return _same_state(_everything(copy_), before)

        def torch_save():
            torch.save(replica, path)
            return check_copy(torch.load(path, weights_only=False))
        _check(r, "torch_save_file", torch_save)

        def torch_save_buffer():
            buf = io.BytesIO()
            torch.save(replica, buf)
            buf.seek(0)
            return check_copy(torch.load(buf, weights_only=False))
        _check(r, "torch_save_buffer", torch_save_buffer)
        _check(r, "pickle", lambda: check_copy(pickle.loads(pickle.dumps(replica))))
        _check(r, "deepcopy", lambda: check_copy(copy.deepcopy(replica)))
        _check(r, "unchanged", lambda: _same_state(_everything(replica), before, "the replica after the copies"))
        results.update(_flat(name, r))

    # a save that fails: a replica holding a lock fails exactly as the original does, and stays a usable replica
    def failing(m: nn.Module, tag: str):
        path = os.path.join(tmp, f"locked_{tag}_rank{rank}.pt")
        try:
            torch.save(m, path)
        except Exception as e:
            return type(e).__name__, str(e), os.path.exists(path), os.path.getsize(path) if os.path.exists(path) else 0
        return None, "", os.path.exists(path), 0

    torch.manual_seed(0)
    original = _Locked()
    torch.manual_seed(rank)
    locked = zb.frozen_replica(_Locked())
    snap = {k: v.clone() for k, v in locked.state_dict().items()}
    plain, frozen = failing(original, "original"), failing(locked, "replica")
    results["locked.raises"] = frozen[0] is not None or "torch.save of an unpicklable replica did not raise"
    results["locked.same_error_as_original"] = frozen[:2] == plain[:2] or f"{frozen[:2]} != original's {plain[:2]}"
    # (the archive's sizes differ by the file name torch writes into it: compare whether a file was left)
    results["locked.partial_file_as_original"] = frozen[2] == plain[2] or f"{frozen[2:]} != original's {plain[2:]}"
    results["locked.unchanged"] = (zb.is_frozen_replica(locked)
                                   and _same_state(locked.state_dict(), snap) is True) or "the replica changed"
    results["locked.partial"] = plain[2:]  # reported, not asserted (popped by the test): torch's own behaviour
    return results


def test_torch_save_pickle_and_deepcopy_round_trip(ranks2, tmp_path):
    out = ranks2.run(_serialisation, str(tmp_path), timeout=180)
    partial = [r.pop("locked.partial") for r in out]
    _assert_all(out)
    # torch.save opens the zip archive before pickling: a failed save leaves a partial file, for any module (not
    # something frozen_replica can change); pinned so a change in torch shows up here
    assert all(exists and size > 0 for exists, size in partial), partial


# ----------------------------------------------------------------------- 4. a submodule under deepspeed.initialize
class _WithFrozenEncoder(nn.Module):
    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.enc = encoder
        self.head = nn.Linear(16, 2)

    def forward(self, ids):
        h = self.enc(input_ids=ids).last_hidden_state[:, 0]
        return self.head(h.to(self.head.weight.dtype))


def _under_engine(rank, world, precision):
    deepspeed = init_deepspeed()
    results: dict = {}
    ref = tiny_bert(0)
    replica = zb.frozen_replica(tiny_bert(rank))
    keys = list(replica.state_dict().keys())
    before = {k: v.clone() for k, v in replica.state_dict().items()}
    cfg = {**ZERO3_CONFIG, "train_micro_batch_size_per_gpu": 2, "zero_allow_untested_optimizer": True}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    torch.manual_seed(0)
    model = _WithFrozenEncoder(replica)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1),
                                      config=cfg)
    ids = _ids()
    for _ in range(2):
        engine.backward(engine(ids).float().sum())
        engine.step()
    _check(results, "engine_params", lambda: [n for n, _ in engine.module.named_parameters()]
           == ["head.weight", "head.bias"] or [n for n, _ in engine.module.named_parameters()])
    _check(results, "head_partitioned", lambda: all(hasattr(p, "ds_id") for p in model.head.parameters())
           or "the trainable head is not a ZeRO-3 parameter")
    _check(results, "not_partitioned", lambda: not any(hasattr(t, "ds_id") or t.numel() == 0
                                                       for t in list(replica.parameters()) + list(replica.buffers()))
           or "a replica tensor was partitioned")
    _check(results, "api", lambda: (replica.dtype, replica.device, type(next(iter(replica.parameters()))))
           == (torch.float32, torch.device("cpu"), torch.Tensor) or "dtype / device / next(parameters())")
    _check(results, "dtype_unchanged", lambda: all(t.dtype == before[k].dtype for k, t in replica.state_dict().items())
           or "a replica tensor was cast")
    _check(results, "state_dict_keys", lambda: list(replica.state_dict().keys()) == keys or "keys changed")
    _check(results, "engine_state_dict_keys", lambda: [k[4:] for k in engine.module.state_dict() if
                                                       k.startswith("enc.")] == keys or "keys changed")
    _check(results, "values_unchanged", lambda: _same_state(replica.state_dict(), before, "after training"))
    _check(results, "eval", lambda: not any(m.training for m in replica.modules()) or "a module in train mode")
    calls: list = []
    real = log_collectives(calls)
    undo = log_deepspeed_comm(calls)
    try:
        out = replica(input_ids=ids).last_hidden_state
    finally:
        undo()
        restore_collectives(real)
    results["no_collective_in_forward"] = calls == [] or f"collectives: {calls[:5]}"
    _check(results, "forward", lambda: _equal(out, ref(input_ids=ids).last_hidden_state))
    return results


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_replica_as_a_submodule_under_deepspeed_zero3(ranks2, precision):
    """Not partitioned, not cast, no DeepSpeed collective in its forward, state_dict keys unchanged, API intact."""
    _assert_all(ranks2.run(_under_engine, precision, timeout=240), precision)


# ------------------------------------------------------- 5. the replica itself given to deepspeed / Accelerate
def _as_engine_model(rank, world):
    deepspeed = init_deepspeed()
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.state import AcceleratorState
    from accelerate.utils import InitProcessGroupKwargs

    results: dict = {}
    replica = zb.frozen_replica(tiny_bert(rank))
    before = {k: v.clone() for k, v in replica.state_dict().items()}

    def untouched():
        if any(hasattr(t, "ds_id") for t in list(replica.parameters()) + list(replica.buffers())):
            return "partitioned"
        return _same_state(replica.state_dict(), before, "after the refused call")

    def refused(call):
        try:
            call()
        except zb.InvalidArgumentError as e:
            return "frozen replica" in str(e) or f"message: {e}"
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return "did not raise"

    _check(results, "deepspeed.initialize", lambda: refused(lambda: deepspeed.initialize(
        model=replica, config={**ZERO3_CONFIG, "train_micro_batch_size_per_gpu": 2})))
    _check(results, "deepspeed.untouched", untouched)
    env = dict(os.environ)
    AcceleratorState._reset_state(True)
    try:
        plugin = DeepSpeedPlugin(zero_stage=3, zero3_init_flag=False, zero3_save_16bit_model=True)
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 2
        acc = Accelerator(deepspeed_plugin=plugin, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
        _check(results, "accelerate.prepare", lambda: refused(lambda: acc.prepare(replica)))
        _check(results, "accelerate.untouched", untouched)
        torch.manual_seed(0)
        net = nn.Linear(4, 2)
        acc.prepare(net, torch.optim.AdamW(net.parameters(), lr=0.1))  # something was prepared

        def get_state_dict():
            sd = acc.get_state_dict(replica)
            return _same_state(dict(sd), replica.state_dict(), "get_state_dict(replica)")
        _check(results, "accelerate.get_state_dict", get_state_dict)
    finally:
        AcceleratorState._reset_state(True)
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config
        unset_hf_deepspeed_config()
        os.environ.clear()
        os.environ.update(env)
    _check(results, "still_usable", lambda: _equal(replica(input_ids=_ids()).last_hidden_state,
                                                   tiny_bert(0)(input_ids=_ids()).last_hidden_state))
    return results


def test_replica_given_to_deepspeed_or_accelerate_raises_invalid_argument(ranks2):
    """deepspeed.initialize(model=replica) / accelerator.prepare(replica) under ZeRO-3 raise InvalidArgumentError
    (not DeepSpeed's IndexError, never silent partitioning); get_state_dict(replica) gives its full state dict."""
    _assert_all(ranks2.run(_as_engine_model, timeout=240))


# ------------------------------------------------------------------------------------------- 6. the whole corpus
def _corpus(rank, world, tmp):
    from tests.corpus import CORPUS, api_checks, cast_example  # noqa: F401

    results: dict = {}
    states: dict = {}
    for arch in CORPUS:
        r: dict = {}
        ref = arch.build(0)  # the source rank's model
        ex = arch.example(2, 0)
        ref.eval()
        with torch.no_grad():
            expected = arch.forward(ref, ex)
        replica = zb.frozen_replica(arch.build(rank))
        _check(r, "is_replica", lambda: (zb.is_frozen_replica(replica) and type(replica).__name__ == type(ref).__name__
               and real_parameters(replica) == 0) or "not a replica")
        _check(r, "state", lambda: _same_state(_everything(replica), _everything(ref)))
        _check(r, "forward", lambda: _equal(arch.forward(replica, ex), expected))  # no eval / no_grad by the caller
        folder = os.path.join(tmp, f"{arch.name}_rank{rank}")
        os.makedirs(folder, exist_ok=True)
        _check(r, "api_checks", lambda: {k: v for k, v in api_checks(replica, folder, arch).items() if v is not True}
               or True)
        states[arch.name] = {k: v.clone() for k, v in _everything(replica).items()}
        results.update(_flat(arch.name, r))
    return results, states


def test_whole_corpus_through_frozen_replica(ranks, tmp_path):
    """Every corpus architecture: identical on every rank, api_checks all True, forward equal to the source rank's
    model."""
    out = ranks.run(_corpus, str(tmp_path), timeout=600)
    _assert_all([r for r, _ in out], f"world {ranks.world_size}")
    first = out[0][1]
    for rank, (_, states) in enumerate(out):
        for name, state in states.items():
            assert _same_state(state, first[name]) is True, (rank, name)


# ------------------------------------------------------------------------- 7. nesting, and the replica's class
class _Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x):
        return self.lin(x)

    def encode(self, x):
        return self.lin(x) * 2


def _nested(rank, world):
    results: dict = {}
    torch.manual_seed(rank)
    inner = zb.frozen_replica(_Encoder())
    x = torch.ones(1, 2, requires_grad=True)
    results["inner_alone"] = (not inner(x).requires_grad and not inner.encode(x).requires_grad) or "tracked"
    outer = zb.frozen_replica(nn.ModuleDict({"enc": inner, "head": nn.Linear(2, 2)}))
    results["outer"] = (zb.is_frozen_replica(outer) and len(list(outer.parameters())) == 4) or "outer not a replica"
    results["inner_forward_no_grad"] = not inner(x).requires_grad or "inner forward tracked after the outer call"
    results["inner_encode_no_grad"] = not inner.encode(x).requires_grad or "inner encode tracked after the outer call"
    return results


def test_an_outer_replica_keeps_an_inner_replicas_no_grad_methods(ranks2):
    _assert_all(ranks2.run(_nested, timeout=60))


def _from_frozen_class(rank, world, tmp):
    from tests.corpus import save_on_every_rank

    replica = zb.frozen_replica(tiny_bert(rank))
    path = os.path.join(tmp, f"rank{rank}")
    with save_on_every_rank(replica):
        replica.save_pretrained(path)
    loaded = type(replica).from_pretrained(path)  # what generic code (and tests/corpus.api_checks) does
    results: dict = {"not_frozen": not zb.is_frozen_replica(loaded) or "a frozen class holding real parameters"}
    loaded.train()
    results["trainable"] = loaded.training or "train() left it in eval mode"
    try:
        loaded.requires_grad_(True)
        results["requires_grad_"] = True
    except zb.InvalidArgumentError as e:
        results["requires_grad_"] = f"InvalidArgumentError: {e}"
    return results


def test_the_replicas_class_builds_a_normal_model(ranks2, tmp_path):
    _assert_all(ranks2.run(_from_frozen_class, str(tmp_path), timeout=60))


def test_a_cast_asked_of_the_replica_itself_is_honoured_a_parents_is_not():
    replica = zb.frozen_replica(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
    parent = nn.Sequential(replica, nn.Linear(2, 2))
    parent.bfloat16()
    assert parent[1].weight.dtype == torch.bfloat16
    assert {t.dtype for t in replica.buffers() if t.is_floating_point()} == {torch.float32}  # the parent's: ignored
    replica.half()
    assert {t.dtype for t in replica.buffers() if t.is_floating_point()} == {torch.float16}  # its own: done
    replica.to(torch.float64)
    assert {t.dtype for t in replica.buffers() if t.is_floating_point()} == {torch.float64}
    assert replica[1].num_batches_tracked.dtype == torch.int64


# ----------------------------------------------------- 8. on real ZeRO-3 ranks: identical, idempotent, through training
def pretrained() -> dict[str, torch.Tensor]:
    torch.manual_seed(2024)
    ref = Tokenizer()
    with torch.no_grad():
        ref.bn.running_mean.uniform_(-1, 1)
        ref.bn.running_var.uniform_(0.5, 2)
        ref.bn.num_batches_tracked.fill_(10)
    return ref.state_dict()


def _frozen(rank, world, src):
    deepspeed = init_deepspeed()
    torch.manual_seed(rank)
    with deepspeed.zero.Init(config_dict_or_path=ZERO3_CONFIG):
        tok = Tokenizer()
    with deepspeed.zero.GatheredParameters(list(tok.parameters()), modifier_rank=0):
        if rank == 0:
            tok.load_state_dict(pretrained())  # incident 1: only rank 0 gets the buffers
    keys = list(tok.state_dict().keys())
    before = buffers(tok)
    replica = zb.frozen_replica(tok, src=src)
    calls: list = []
    real = log_collectives(calls)  # torch.distributed's functions ...
    undo = log_deepspeed_comm(calls)  # ... and DeepSpeed's comm backend, which ZeRO-3's all-gathers go through
    try:
        parent = nn.Sequential(replica)
        parent.train()  # a training loop switching everything to train mode must not move BN stats
        replica.bn.train()  # nor a call on an inner module
        x = torch.ones(2, 3, 4, 4, 4, requires_grad=True)  # autograd would track the output through x
        y = replica(x)
    finally:
        undo()
        restore_collectives(real)
    # the control: the same module and input through the unfrozen class's forward (no no_grad) is tracked
    control = Tokenizer.forward(replica, x)
    state = replica.state_dict()
    weights = list(replica.parameters())
    return dict(same_object=replica is tok, keys=keys, new_keys=list(state.keys()), state=state, calls=calls,
                y=y.detach(), grad=y.requires_grad or y.grad_fn is not None,
                control_grad=control.requires_grad and control.grad_fn is not None,
                params=len(weights), real_params=sum(len(m._parameters) for m in replica.modules()),
                plain_weights=all(type(w) is torch.Tensor and not hasattr(w, "ds_id") and w.numel() > 0
                                  and not w.requires_grad for w in weights),
                own_params=len(list(replica.parameters(recurse=False))),
                frozen=zb.is_frozen_replica(replica) and all(zb.is_frozen_replica(m) for m in replica.modules()),
                names=[type(m).__name__ for m in replica.modules()],
                training=replica.training or any(m.training for m in replica.modules()),
                tied=replica.proj.weight is replica.proj2.weight, before=before, name=type(replica).__name__,
                stats_after=buffers(replica))


@pytest.mark.parametrize("src_kind", ["rank0", "last"])
def test_frozen_replica_is_a_full_identical_no_grad_replica(ranks, src_kind):
    src = 0 if src_kind == "rank0" else ranks.world_size - 1
    out = ranks.run(_frozen, src, timeout=120)
    sd = pretrained()
    for r in out:
        assert r["same_object"] and r["frozen"]
        # every module keeps its class name (save_pretrained / pickling name the original class)
        assert r["name"] == "Tokenizer" and r["names"] == ["Tokenizer", "Conv3d", "BatchNorm3d", "Linear", "Linear"]
        assert r["new_keys"] == r["keys"]  # same state_dict keys, same order
        assert same_state(r["state"], out[src]["state"])  # everything equals rank src's
        assert r["calls"] == []  # forward: no all-gather, no broadcast
        assert not r["grad"] and r["control_grad"]  # forward runs under no_grad, even for an input needing grad
        # parameters() yields the 7 weights (the tied one once) as full plain tensors, without ds_id; no real
        # nn.Parameter is left anywhere, and the per-module walk (recurse=False) engines use sees none
        assert r["params"] == 7 and r["plain_weights"] and r["real_params"] == 0 and r["own_params"] == 0
        assert not r["training"] and r["tied"]
        assert torch.equal(r["y"], out[0]["y"])  # same output on every rank for the same input
        assert same_state(r["stats_after"], {k: r["state"][k] for k in r["stats_after"]})  # BN did not update
    if src == 0:
        assert same_state({k: out[-1]["state"][k] for k in sd}, sd)  # rank 0's checkpoint reached the last rank
    assert not torch.equal(out[-1]["before"]["bn.running_mean"], sd["bn.running_mean"])  # it did not before


def _in_engine(rank, world, path):
    deepspeed = init_deepspeed()
    torch.manual_seed(rank)
    cfg = {**ZERO3_CONFIG, "train_micro_batch_size_per_gpu": 2, "zero_allow_untested_optimizer": True}
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        tok = Tokenizer()
    with deepspeed.zero.GatheredParameters(list(tok.parameters()), modifier_rank=0):
        if rank == 0:
            tok.load_state_dict(pretrained())
    tok = zb.frozen_replica(tok)
    frozen = {k: v.clone() for k, v in tok.state_dict().items()}

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = tok
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.tok(x))

    model = Model()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1),
                                      config=cfg)
    x = torch.randn(2, 3, 4, 4, 4)
    for _ in range(2):
        engine.backward(engine(x).sum())
        engine.step()
    trained = {k: v.clone() for k, v in tok.state_dict().items()}
    engine.save_checkpoint(path, tag="t")
    with torch.no_grad():
        tok.bn.running_mean.fill_(123.0)  # clobber, then restore from the checkpoint
    engine.load_checkpoint(path, tag="t")
    head_partitioned = all(hasattr(p, "ds_id") for p in model.head.parameters())  # small ones stay resident
    whole = (len(list(tok.parameters())) == 7 and not any(hasattr(t, "ds_id") for t in tok.parameters())
             and not any(hasattr(t, "ds_id") for t in tok.buffers()) and zb.is_frozen_replica(tok)
             and sum(len(m._parameters) for m in tok.modules()) == 0
             and [n for n, _ in engine.module.named_parameters()] == ["head.weight", "head.bias"])
    return (frozen, trained, {k: v.clone() for k, v in tok.state_dict().items()}, head_partitioned, whole,
            tok.training)


def test_frozen_replica_survives_deepspeed_initialize_training_and_checkpoints(ranks, tmp_path):
    out = ranks.run(_in_engine, str(tmp_path), timeout=180)
    sd = pretrained()
    for frozen, trained, reloaded, head_partitioned, whole, training in out:
        assert head_partitioned  # the engine took the trainable part under ZeRO-3 ...
        assert same_state(trained, frozen) and same_state(reloaded, frozen)  # ... and left the replica whole
        assert whole and not training  # not partitioned, not an engine parameter, still in eval mode
        assert same_state({k: frozen[k] for k in sd}, sd)


def _frozen_twice_and_failing(rank, world):
    torch.manual_seed(rank)
    tok = zb.frozen_replica(Tokenizer())  # no DeepSpeed at all: plain per-rank random init gets aligned
    first = buffers(tok)
    with torch.no_grad():
        tok.bn.running_mean.add_(rank)
    again = zb.frozen_replica(tok, src=world - 1)  # already a replica: just re-broadcast
    lone = Tokenizer() if rank == 0 else nn.Sequential(Tokenizer(), nn.BatchNorm1d(2))
    classes = [type(m) for m in lone.modules()]
    params = {n: p for n, p in lone.named_parameters()}
    bufs = {n: b for n, b in lone.named_buffers()}
    keys = list(lone.state_dict().keys())
    try:
        zb.frozen_replica(lone)
    except zb.BufferStructureError:
        failed = True
    else:
        failed = False
    restored = ([type(m) for m in lone.modules()] == classes
                and not any(zb.is_frozen_replica(m) for m in lone.modules())
                and {n: p for n, p in lone.named_parameters()} == params  # the very same nn.Parameter objects
                and all(isinstance(p, nn.Parameter) and p.requires_grad for p in lone.parameters())
                and {n: b for n, b in lone.named_buffers()} == bufs and list(lone.state_dict().keys()) == keys
                and not any("_zb_weights" in vars(m) for m in lone.modules()))
    twice = (zb.is_frozen_replica(again) and len(list(again.parameters())) == 7
             and sum(len(m._parameters) for m in again.modules()) == 0
             and list(again.state_dict().keys()) == list(Tokenizer().state_dict().keys()))
    return first, buffers(again), type(again).__name__, failed, restored, twice


def test_frozen_replica_is_idempotent_and_a_failed_call_changes_nothing(ranks):
    out = ranks.run(_frozen_twice_and_failing)
    f0, a0 = out[0][0], out[0][1]
    for first, again, name, failed, restored, twice in out:
        assert same_state(first, f0) and same_state(again, a0) and name == "Tokenizer" and twice
        assert failed and restored
    assert torch.equal(a0["bn.running_mean"], f0["bn.running_mean"] + ranks.world_size - 1)  # the last rank's won
