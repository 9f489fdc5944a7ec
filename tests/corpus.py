"""A corpus of REAL architectures from libraries (not written by us), tiny configs, random init, built in code.

Multi-rank tests run every zero_buffers tool on these. No hub, no downloads: every model is built from a config.

    from tests.corpus import CORPUS, by_name, api_checks
    arch = by_name("hf_resnet34")
    model = arch.build(seed=rank)   # deterministic given seed; other seeds -> other weights AND buffers
    out = arch.forward(model, arch.example(2, seed=0))
    assert all(v is True for v in api_checks(model, tmpdir).values())

`build(seed)` gives every BatchNorm seed-dependent running statistics (as if pretrained or trained on a rank's own
shard: running_mean ~ N(0, 0.1^2), running_var ~ U(0.5, 1.5), num_batches_tracked in [1, 10^6)); pass
`stats=False` for the library's fresh init (zeros / ones / 0 on every rank). The VQ entry instead takes two real
EMA steps on seed-dependent data. Deterministic non-persistent buffers (rotary `inv_freq`, the remote model's
`input_scale`, vector-quantize's `zero`) are the same for every seed, as they are in real use.

Measured (2-core CPU, OMP_NUM_THREADS=1, imports already done; build = build(seed); fwd = one train-mode plus one
eval-mode forward at batch 2; buffers = named_buffers (non-persistent); BN = _BatchNorm modules). Same numbers
(within noise) under transformers 5.24.0 + diffusers 0.42.1 and transformers 4.57.6 + diffusers 0.39.0, except
where a row says which:

  entry               | build s | fwd s | buffers (non-pers.) | BN | params | non-persistent names
  --------------------+---------+-------+---------------------+----+--------+------------------------------------
  hf_resnet34         | 0.02-04 | 0.020 | 108 (0)             | 36 | 50972  |
  hf_mobilenet_v2     | 0.029   | 0.025 | 156 (0)             | 52 | 160676 |
  hf_regnet           | 0.010   | 0.005 | 27 (0)              | 9  | 3048   |
  hf_llama  tf 5.24   | 0.003   | 0.002 | 2 (2)               | 0  | 7248   | rotary_emb.{inv_freq, original_inv_freq}
  hf_llama  tf 4.57   | 0.002   | 0.007 | 1 (1)               | 0  | 7248   | model.rotary_emb.inv_freq
  diffusers_vqmodel   | 0.012   | 0.021 | 0 (0)               | 0  | 43143  |
  diffusers_flux2_vae | 0.014   | 0.005 | 3 (0)               | 1  | 43711  |
  swa_ema_resnet      | 0.018   | 0.003 | 19 (0)              | 6  | 6124   | (18 BN buffers + int64 n_averaged)
  vq_ema              | 0.001   | 0.001 | 5 (1)               | 0  | 0      | zero
  remote_tiny_vq      | 0.031*  | 0.002 | 8 (1)               | 2  | 1895   | input_scale (+ 6 BN, codebook)

  * save_pretrained + AutoModel.from_pretrained(trust_remote_code=True). In a fresh process the first load (copy
    and import of the code) is 0.1-0.25 s, after ~4 s of importing torch/transformers/deepspeed.
  api_checks takes 0.03-0.9 s per entry (save_pretrained/from_pretrained dominate); all entries x stats True/False,
  each after a training forward: 3.7 s in total.

Notes, honest:
- diffusers VQModel has NO buffers at all (its VectorQuantizer keeps the codebook as an nn.Embedding parameter; the
  only buffer, `used`, exists only with a `remap` .npy file). It is kept as the "nothing to sync" case. The diffusers
  model with a real buffer is AutoencoderKLFlux2: a BatchNorm2d(affine=False) over patchified latents whose running
  stats the Flux2 pipelines read to normalise latents (`pipeline_flux2.py`, `_encode_vae_image`). The VAE's own
  forward never uses or updates them, so `forward` here is the pipeline's latent normalisation (encode -> mode ->
  patchify -> (z - running_mean) / sqrt(running_var + eps)), which is where diverged stats change outputs.
- vector-quantize-pytorch's non-persistent `zero` buffer is returned as the loss and gets `requires_grad_()` called
  on it during a training forward, even under torch.no_grad(): the built model (stats=True) already has a BUFFER
  that requires grad (in-place writes to it outside `torch.no_grad()` raise). VectorQuantize with EMA has no
  parameters at all (`next(parameters())` raises). Its default `sync_codebook` turns on by itself under
  torch.distributed (training forwards become collectives); the corpus builds it with sync_codebook=False
  (see build_vq_ema).
- transformers 5 has a second non-persistent rotary buffer `original_inv_freq`; in 4.57 it is a plain attribute.
- transformers 5 `from_pretrained` builds on the meta device and leaves non-persistent buffers `empty_like` unless
  `_init_weights` sets them (it does for rotary tables; tests/remote_code's model does it for `input_scale`; real
  remote-code models often do not: `pretrained_non_persistent` in api_checks catches that).
- remote_tiny_vq is our code on purpose (the loading path is the point): see tests/remote_code/. Its class is not
  named "...Tokenizer": transformers' custom_object_save then writes a tokenizer-style [slow, fast] auto_map entry
  that AutoModel cannot load. The code lands in HF_MODULES_CACHE (transformers 5: .../zb_tiny_vq/<source hash>/,
  4.57: .../zb_tiny_vq/ only), so `load_remote_model` resolves it under a file lock first (ranks in parallel).
- transformers 5 `save_pretrained` silently writes nothing on ranks != 0 once torch.distributed is initialised
  (4.57 does); api_checks and save_remote_model lift that gate per object (`save_on_every_rank`). diffusers has
  no such gate. Checked on 2 gloo ranks (tests/multirank.RankPool) under both transformers versions: every entry
  builds, buffer_report sees the seeded divergence, broadcast_buffers / average_bn_stats fix it, api_checks all True.
- torch's `get_ema_multi_avg_fn(decay)` returns a closure: an AveragedModel holding it cannot be pickled or
  torch.save'd, so swa_ema_resnet uses the module-level `ema_avg_fn` (same EMA, per tensor).
"""
from __future__ import annotations

import contextlib
import copy
import importlib.metadata as _md
import io
import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def _version(dist: str) -> str:
    try:
        return _md.version(dist)
    except _md.PackageNotFoundError:
        return "missing"


TRANSFORMERS_VERSION = _version("transformers")
TF5 = TRANSFORMERS_VERSION.split(".")[0].isdigit() and int(TRANSFORMERS_VERSION.split(".")[0]) >= 5


# ----------------------------------------------------------------------------------------------------------- helpers

@contextlib.contextmanager
def _seeded(seed: int):
    """Seed torch's global RNG for a build without leaking the change to the caller."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def seed_bn_stats(model: nn.Module, seed: int) -> nn.Module:
    """Give every tracking BatchNorm seed-dependent running statistics (as if pretrained / trained on one shard)."""
    g = torch.Generator().manual_seed(7919 * seed + 17)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats and m.running_mean is not None:
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
                m.num_batches_tracked.fill_(int(torch.randint(1, 10**6, (), generator=g)))
    return model


def non_persistent_buffers(model: nn.Module) -> list[str]:
    """Names of the model's non-persistent buffers, computed (not declared)."""
    out = []
    for mname, m in model.named_modules():
        for bname in m._non_persistent_buffers_set:
            if m._buffers.get(bname) is not None:
                out.append(f"{mname}.{bname}" if mname else bname)
    return sorted(out)


def _images(batch: int, seed: int, channels: int = 3, size: int = 32) -> torch.Tensor:
    return torch.randn(batch, channels, size, size, generator=torch.Generator().manual_seed(seed))


def _to_tensor(out: Any) -> torch.Tensor:
    """The main output tensor of a model call: logits / sample / reconstruction / first element."""
    if isinstance(out, torch.Tensor):
        return out
    for key in ("logits", "reconstruction", "sample", "latents", "last_hidden_state"):
        value = getattr(out, key, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    if hasattr(out, "to_tuple"):
        return _to_tensor(out.to_tuple())
    raise TypeError(f"cannot find an output tensor in {type(out).__name__}")


def default_forward(model: nn.Module, example: Any) -> torch.Tensor:
    """`model(**example)` for a dict of kwargs, `model(example)` for a tensor; returns the main output tensor."""
    out = model(**example) if isinstance(example, dict) else model(example)
    return _to_tensor(out)


@dataclass(frozen=True)
class Arch:
    name: str
    build: Callable[..., nn.Module]            # build(seed: int, *, stats: bool = True) -> nn.Module
    example: Callable[[int, int], Any]         # example(batch, seed) -> tensor or dict of kwargs
    library: str                               # e.g. "transformers 5.24.0"
    has_bn: bool                               # has BatchNorm modules tracking running stats
    non_persistent: tuple[str, ...] = ()       # declared non-persistent buffer names (checked against the model)
    forward: Callable[[nn.Module, Any], torch.Tensor] = default_forward
    codec: Callable[[nn.Module, Any], torch.Tensor] | None = None  # decode(encode(x)), where the model has them
    notes: str = ""


# ------------------------------------------------------------------------------------------- 1-3 transformers vision

def build_resnet34(seed: int, *, stats: bool = True) -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 8, 16, 16], depths=[3, 4, 6, 3],
                       layer_type="basic", hidden_act="relu", num_labels=4)
    with _seeded(seed):
        model = ResNetForImageClassification(cfg)
    return seed_bn_stats(model, seed) if stats else model


def build_mobilenet_v2(seed: int, *, stats: bool = True) -> nn.Module:
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

    cfg = MobileNetV2Config(num_channels=3, image_size=32, depth_multiplier=0.25, min_depth=4,
                            finegrained_output=False, num_labels=4)
    with _seeded(seed):
        model = MobileNetV2ForImageClassification(cfg)
    return seed_bn_stats(model, seed) if stats else model


def build_regnet(seed: int, *, stats: bool = True) -> nn.Module:
    from transformers import RegNetConfig, RegNetForImageClassification

    cfg = RegNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], groups_width=8,
                       layer_type="y", num_labels=4)
    with _seeded(seed):
        model = RegNetForImageClassification(cfg)
    return seed_bn_stats(model, seed) if stats else model


def _pixel_values(batch: int, seed: int) -> dict:
    return {"pixel_values": _images(batch, seed)}


# ------------------------------------------------------------------------------------------------ 4 transformers LLM

def build_llama(seed: int, *, stats: bool = True) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    with _seeded(seed):
        model = LlamaForCausalLM(cfg)
    inv = model.model.rotary_emb.inv_freq
    if inv.is_meta or not torch.isfinite(inv).all():  # transformers 5 could leave it for _init_weights: never seen
        raise RuntimeError("LlamaRotaryEmbedding.inv_freq is not a real tensor after construction")
    return model


def _input_ids(batch: int, seed: int) -> dict:
    return {"input_ids": torch.randint(0, 64, (batch, 8), generator=torch.Generator().manual_seed(seed))}


_LLAMA_NON_PERSISTENT = ("model.rotary_emb.inv_freq",) + (("model.rotary_emb.original_inv_freq",) if TF5 else ())


# --------------------------------------------------------------------------------------------------- 5 diffusers

def build_vqmodel(seed: int, *, stats: bool = True) -> nn.Module:
    from diffusers import VQModel

    with _seeded(seed):
        return VQModel(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                       up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                       latent_channels=4, num_vq_embeddings=16, norm_num_groups=4, vq_embed_dim=4, sample_size=16)


def _vq_codec(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model.decode(model.encode(x).latents).sample


def build_flux2_vae(seed: int, *, stats: bool = True) -> nn.Module:
    from diffusers import AutoencoderKLFlux2

    with _seeded(seed):
        model = AutoencoderKLFlux2(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                                   up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16),
                                   layers_per_block=1, latent_channels=4, norm_num_groups=4, sample_size=16,
                                   patch_size=(2, 2))
    return seed_bn_stats(model, seed) if stats else model


def flux2_normalized_latents(vae: nn.Module, image: torch.Tensor) -> torch.Tensor:
    """What diffusers' Flux2 pipelines do with the VAE (pipeline_flux2.py `_encode_vae_image`, argmax mode)."""
    latents = vae.encode(image).latent_dist.mode()
    b, c, h, w = latents.shape  # Flux2Pipeline._patchify_latents
    latents = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(latents.device, latents.dtype)
    return (latents - mean) / std


def _flux2_codec(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model.decode(model.encode(x).latent_dist.mode()).sample


def _small_images(batch: int, seed: int) -> torch.Tensor:
    return _images(batch, seed, size=16)


# ------------------------------------------------------------------------------------------- 6 EMA (AveragedModel)

def ema_avg_fn(averaged: torch.Tensor, current: torch.Tensor, num_averaged: torch.Tensor, decay: float = 0.9):
    """EMA step for AveragedModel(avg_fn=...). A module-level function because torch's own
    `get_ema_multi_avg_fn(decay)` returns a closure: an AveragedModel holding it cannot be pickled or torch.save'd."""
    return decay * averaged + (1.0 - decay) * current


def build_swa_ema_resnet(seed: int, *, stats: bool = True) -> nn.Module:
    """torch's AveragedModel(use_buffers=True) EMA of a small transformers ResNet, after two EMA updates."""
    from torch.optim.swa_utils import AveragedModel
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
                       hidden_act="relu", num_labels=4)
    with _seeded(seed):
        student = ResNetForImageClassification(cfg)
    if stats:
        seed_bn_stats(student, seed)
    ema = AveragedModel(student, avg_fn=ema_avg_fn, use_buffers=True)
    if stats:  # two EMA steps towards a moved student: n_averaged = 2, buffers no longer equal the student's
        for step in (1, 2):
            seed_bn_stats(student, 1000 * seed + step)
            with torch.no_grad():
                for p in student.parameters():
                    p.mul_(0.9)
            ema.update_parameters(student)
    return ema


# --------------------------------------------------------------------------------- 7 vector-quantize-pytorch EMA VQ

def build_vq_ema(seed: int, *, stats: bool = True, sync_codebook: bool = False) -> nn.Module:
    """VectorQuantize with EMA codebook buffers.

    `sync_codebook=False` by default so that the build (and every training forward) is rank-local and
    deterministic given the seed. The library's own default is `sync_codebook=None` -> True whenever
    torch.distributed is initialised: then every training forward is a COLLECTIVE (all_reduce of the new
    cluster sizes and embedding sums: all ranks must call it, or it hangs); ranks still keep different
    `embed_avg` / `embed` when they started from different random codebooks (only the updates are summed)."""
    from vector_quantize_pytorch import VectorQuantize

    with _seeded(seed):
        vq = VectorQuantize(dim=8, codebook_size=16, decay=0.8, commitment_weight=1.0, sync_codebook=sync_codebook)
    if stats:  # two real EMA steps on seed-dependent data: cluster_size / embed_avg / embed all move
        g = torch.Generator().manual_seed(seed + 101)
        vq.train()
        with torch.no_grad():
            for _ in range(2):
                vq(torch.randn(2, 10, 8, generator=g) + seed)
    return vq


def _vq_tokens(batch: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, 10, 8, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------- 8 custom modelling code, trust_remote_code

REMOTE_DIR_NAME = "zb_tiny_vq"


def build_remote_original(seed: int, *, stats: bool = True) -> nn.Module:
    """The model from tests/remote_code imported as a normal module (what the author has before publishing it)."""
    from tests.remote_code.configuration_tiny_vq import TinyVQConfig
    from tests.remote_code.modeling_tiny_vq import TinyVQVideoModel

    with _seeded(seed):
        model = TinyVQVideoModel(TinyVQConfig())
    return seed_bn_stats(model, seed) if stats else model


@contextlib.contextmanager
def save_on_every_rank(model: nn.Module):
    """Let `model.save_pretrained` write on this rank, whatever the rank.

    transformers 5 (`distributed/mixin.py`, `should_save_on_this_rank`) writes NOTHING from `save_pretrained` on
    ranks != 0 once torch.distributed is initialised, even with `is_main_process=True` (no error: an empty folder;
    a later `from_pretrained` of it fails). transformers 4.57 has no such gate. This lifts the gate on this one
    object for the duration (is_main_process is still obeyed); a no-op where the method does not exist."""
    if not hasattr(type(model), "should_save_on_this_rank"):
        yield model
        return
    model.should_save_on_this_rank = lambda is_main_process: is_main_process
    try:
        yield model
    finally:
        del model.should_save_on_this_rank


def save_remote_model(tmpdir: str | os.PathLike, seed: int, *, stats: bool = True, every_rank: bool = True) -> str:
    """Build the custom-code model and save it so that only trust_remote_code can load it: auto_map + code files.

    Returns the model folder (`<tmpdir>/zb_tiny_vq`). With `every_rank` (default) this process writes the folder
    even on a rank != 0 (see `save_on_every_rank`), so give each rank a folder of its own; `every_rank=False` keeps
    transformers' own behaviour (transformers 5 under torch.distributed: only rank 0 writes)."""
    from tests.remote_code.configuration_tiny_vq import TinyVQConfig
    from tests.remote_code.modeling_tiny_vq import TinyVQVideoModel

    TinyVQConfig.register_for_auto_class()                   # -> auto_map["AutoConfig"]
    TinyVQVideoModel.register_for_auto_class("AutoModel")  # -> auto_map["AutoModel"]
    model = build_remote_original(seed, stats=stats)
    path = os.path.join(os.fspath(tmpdir), REMOTE_DIR_NAME)
    with save_on_every_rank(model) if every_rank else contextlib.nullcontext():
        model.save_pretrained(path)  # writes config.json with auto_map and copies both .py files next to the weights
    return path


def _modules_cache_lock():
    """Serialise the first copy + import of the remote code into HF_MODULES_CACHE between rank processes."""
    from filelock import FileLock
    from transformers.utils import HF_MODULES_CACHE

    os.makedirs(HF_MODULES_CACHE, exist_ok=True)
    return FileLock(os.path.join(HF_MODULES_CACHE, f".{REMOTE_DIR_NAME}.lock"), timeout=120)


def load_remote_model(path: str | os.PathLike, **kwargs) -> nn.Module:
    """`AutoModel.from_pretrained(path, trust_remote_code=True)`; works in a fresh (spawned) process, offline.

    The code is first resolved (copied into the HF modules cache and imported) under a file lock, so ranks
    loading at once never read a half-copied file; `from_pretrained` itself runs outside the lock, so it can be
    called collectively (ZeRO-3 loading broadcasts)."""
    from transformers import AutoConfig, AutoModel
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    path = os.fspath(path)
    with _modules_cache_lock():
        config = AutoConfig.from_pretrained(path, trust_remote_code=True)
        get_class_from_dynamic_module(config.auto_map["AutoModel"], path)
    return AutoModel.from_pretrained(path, trust_remote_code=True, **kwargs)


_REMOTE_TMP: dict[str, str] = {}


def build_remote_tiny_vq(seed: int, *, stats: bool = True) -> nn.Module:
    """save_remote_model into a per-process temporary folder, then load_remote_model: the trust_remote_code path."""
    if "root" not in _REMOTE_TMP:
        import atexit
        import shutil

        _REMOTE_TMP["root"] = tempfile.mkdtemp(prefix="zb_corpus_remote_")
        atexit.register(shutil.rmtree, _REMOTE_TMP["root"], True)
    folder = os.path.join(_REMOTE_TMP["root"], f"seed{seed}_{int(stats)}")
    path = os.path.join(folder, REMOTE_DIR_NAME)
    if not os.path.isdir(path):
        save_remote_model(folder, seed, stats=stats)
    return load_remote_model(path)


def _video(batch: int, seed: int) -> dict:
    return {"pixel_values": torch.randn(batch, 3, 2, 8, 8, generator=torch.Generator().manual_seed(seed))}


def _remote_codec(model: nn.Module, example: dict) -> torch.Tensor:
    return model.decode(model.encode(example["pixel_values"]))


# ------------------------------------------------------------------------------------------------------- the corpus

_TF = f"transformers {TRANSFORMERS_VERSION}"
_DIFF = f"diffusers {_version('diffusers')}"

CORPUS: tuple[Arch, ...] = (
    Arch("hf_resnet34", build_resnet34, _pixel_values, _TF, has_bn=True,
         notes="ResNetForImageClassification, depths [3,4,6,3] basic blocks: 36 BatchNorm2d, 32x32 images"),
    Arch("hf_mobilenet_v2", build_mobilenet_v2, _pixel_values, _TF, has_bn=True,
         notes="MobileNetV2ForImageClassification, depth_multiplier 0.25: 52 BatchNorm2d"),
    Arch("hf_regnet", build_regnet, _pixel_values, _TF, has_bn=True,
         notes="RegNetForImageClassification (Y blocks with squeeze-excitation): 9 BatchNorm2d"),
    Arch("hf_llama", build_llama, _input_ids, _TF, has_bn=False, non_persistent=_LLAMA_NON_PERSISTENT,
         notes="LlamaForCausalLM hidden 16, 2 layers, 2 heads, vocab 64: only buffers: rotary tables"),
    Arch("diffusers_vqmodel", build_vqmodel, _small_images, _DIFF, has_bn=False, codec=_vq_codec,
         notes="diffusers VQModel: NO buffers (codebook is an nn.Embedding parameter); the nothing-to-sync case"),
    Arch("diffusers_flux2_vae", build_flux2_vae, _small_images, _DIFF, has_bn=True,
         forward=flux2_normalized_latents, codec=_flux2_codec,
         notes="AutoencoderKLFlux2: BatchNorm2d(affine=False) latent stats read by the Flux2 pipelines, never "
               "updated by the VAE's forward; forward here = the pipeline's latent normalisation"),
    Arch("swa_ema_resnet", build_swa_ema_resnet, _pixel_values, f"torch {_version('torch')} + {_TF}", has_bn=True,
         notes="torch.optim.swa_utils.AveragedModel(use_buffers=True) EMA of a transformers ResNet [1,1]: "
               "7 BatchNorm2d plus the int64 n_averaged buffer (persistent)"),
    Arch("vq_ema", build_vq_ema, _vq_tokens, f"vector-quantize-pytorch {_version('vector-quantize-pytorch')}",
         has_bn=False, non_persistent=("zero",),
         notes="VectorQuantize(dim 8, codebook 16, decay 0.8, sync_codebook=False): EMA buffers _codebook.{initted, "
               "cluster_size, embed_avg, embed}, non-persistent `zero` (requires grad after a training step); "
               "no parameters"),
    Arch("remote_tiny_vq", build_remote_tiny_vq, _video, f"{_TF} trust_remote_code (tests/remote_code)",
         has_bn=True, non_persistent=("input_scale",), codec=_remote_codec,
         notes="our custom-code video tokenizer: Conv3d + 2 BatchNorm3d + randn codebook buffer + non-persistent "
               "input_scale, loaded with AutoModel.from_pretrained(trust_remote_code=True)"),
)

_BY_NAME = {a.name: a for a in CORPUS}


def by_name(name: str) -> Arch:
    return _BY_NAME[name]


def arch_of(model: nn.Module) -> Arch | None:
    """The corpus entry a model was built from (by class), or None."""
    from torch.optim.swa_utils import AveragedModel

    cls = type(model).__name__
    table = {"ResNetForImageClassification": "hf_resnet34", "MobileNetV2ForImageClassification": "hf_mobilenet_v2",
             "RegNetForImageClassification": "hf_regnet", "LlamaForCausalLM": "hf_llama",
             "VQModel": "diffusers_vqmodel", "AutoencoderKLFlux2": "diffusers_flux2_vae",
             "VectorQuantize": "vq_ema", "TinyVQVideoModel": "remote_tiny_vq"}
    if isinstance(model, AveragedModel):
        return _BY_NAME["swa_ema_resnet"]
    return _BY_NAME.get(table.get(cls, ""))


# ------------------------------------------------------------------------------------------------------- api_checks

def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """state_dict plus every buffer (non-persistent ones included), detached."""
    out = {k: v.detach() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    for k, v in model.named_buffers():
        out.setdefault(k, v.detach())
    return out


def _compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> bool | str:
    if set(a) != set(b):
        return (f"{what}: keys differ: only in original {sorted(set(a) - set(b))[:5]}, "
                f"only in copy {sorted(set(b) - set(a))[:5]}")
    bad = [k for k in a if not bitwise_same(a[k], b[k])]
    return True if not bad else f"{what}: {len(bad)} tensors differ, e.g. {bad[:5]}"


def bitwise_same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN == NaN; -0.0 != 0.0). Meta tensors are never the same as anything."""
    if a.dtype != b.dtype or a.shape != b.shape or a.is_meta or b.is_meta:
        return False
    a, b = a.detach().cpu().contiguous().reshape(-1), b.detach().cpu().contiguous().reshape(-1)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def cast_example(example: Any, dtype: torch.dtype | None) -> Any:
    """Floating tensors of an example (a tensor or a dict of them) cast to `dtype`, as a user feeding a model would."""
    if dtype is None:
        return example
    if isinstance(example, torch.Tensor):
        return example.to(dtype) if example.is_floating_point() else example
    if isinstance(example, dict):
        return {k: cast_example(v, dtype) for k, v in example.items()}
    return example


def _model_dtype(model: nn.Module) -> torch.dtype | None:
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_floating_point():
            return t.dtype
    return None


def _check(results: dict, name: str, fn: Callable[[], bool | str]) -> None:
    try:
        value = fn()
        results[name] = True if value is True else (value if isinstance(value, str) else f"returned {value!r}")
    except BaseException as e:  # noqa: BLE001 - never raise
        if isinstance(e, KeyboardInterrupt):
            raise
        tb = traceback.extract_tb(e.__traceback__)
        where = f" at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno}" if tb else ""
        results[name] = f"{type(e).__name__}: {e}{where}"


def _finite(t: torch.Tensor) -> bool | str:
    if not isinstance(t, torch.Tensor):
        return f"not a tensor: {type(t).__name__}"
    if t.is_floating_point() and not torch.isfinite(t).all():
        return "non-finite output"
    return True


@contextlib.contextmanager
def eval_no_grad(model: nn.Module):
    """The model in eval mode under no_grad inside; every module's mode restored on exit."""
    was = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, t in was.items():
            m.training = t


def _pretrained_checks(results: dict, prefix: str, model: nn.Module, tmpdir: str) -> None:
    """save_pretrained + ORIGINAL_CLASS.from_pretrained: same state_dict keys and values, same non-persistent
    buffers."""
    if not (hasattr(model, "save_pretrained") and hasattr(type(model), "from_pretrained")):
        return
    holder: dict[str, nn.Module] = {}

    def roundtrip():
        folder = tempfile.mkdtemp(prefix="pretrained_", dir=tmpdir)
        with save_on_every_rank(model):  # transformers 5 writes nothing on ranks != 0 otherwise
            model.save_pretrained(folder)
        holder["loaded"] = type(model).from_pretrained(folder)
        return _compare({k: v for k, v in model.state_dict().items()},
                        {k: v for k, v in holder["loaded"].state_dict().items()}, "state_dict")

    def non_persistent():
        if "loaded" not in holder:
            return "no reloaded model"
        names = non_persistent_buffers(model)
        a = {k: v for k, v in model.named_buffers() if k in names}
        b = {k: v for k, v in holder["loaded"].named_buffers() if k in names}
        return _compare(a, b, "non-persistent buffers")

    _check(results, f"{prefix}pretrained_roundtrip", roundtrip)
    _check(results, f"{prefix}pretrained_non_persistent", non_persistent)


def api_checks(model: nn.Module, tmpdir: str | os.PathLike, arch: Arch | None = None,
               example: Any = None) -> dict[str, bool | str]:
    """Use the model as its user would, after our tools touched it. Returns {check: True or error string}; never raises.

    Checks (where the class has the API): `.dtype` / `.device` agree with the first parameter,
    `next(model.parameters())`, an eval forward (finite), the encode/decode round trip, save_pretrained +
    from_pretrained with the ORIGINAL class (same state_dict keys and values, same non-persistent buffers),
    pickle, copy.deepcopy and torch.save(model) / torch.load(weights_only=False) round trips (state dict plus
    every buffer, bitwise)."""
    from torch.optim.swa_utils import AveragedModel

    results: dict[str, bool | str] = {}
    tmpdir = os.fspath(tmpdir)
    try:
        arch = arch or arch_of(model)
    except Exception as e:  # noqa: BLE001
        results["arch"] = f"{type(e).__name__}: {e}"
    inner = model.module if isinstance(model, AveragedModel) else model
    params = list(model.parameters())

    if params:
        _check(results, "next_parameters", lambda: isinstance(next(model.parameters()), torch.Tensor)
               or "next(parameters()) is not a tensor")
    for attr in ("dtype", "device"):
        if isinstance(getattr(type(inner), attr, None), property):
            def same(attr=attr):
                value = getattr(inner, attr)
                first = next(inner.parameters(), None)
                if first is not None and value != getattr(first, attr):
                    return f"model.{attr} = {value}, first parameter's = {getattr(first, attr)}"
                return True
            _check(results, attr, same)

    if arch is not None:
        ex = example if example is not None else cast_example(arch.example(2, 0), _model_dtype(model))

        def fwd():
            with eval_no_grad(model):
                return _finite(arch.forward(model, ex))
        _check(results, "forward", fwd)
        if arch.codec is not None:
            def codec():
                with eval_no_grad(model):
                    out = arch.codec(model, ex)
                ref = ex["pixel_values"] if isinstance(ex, dict) else ex
                if out.shape != ref.shape:
                    return f"decode(encode(x)) shape {tuple(out.shape)} != input {tuple(ref.shape)}"
                return _finite(out)
            _check(results, "encode_decode", codec)

    _pretrained_checks(results, "module." if inner is not model else "", inner, tmpdir)

    before = _state(model)
    _check(results, "pickle", lambda: _compare(before, _state(pickle.loads(pickle.dumps(model))), "pickle"))
    _check(results, "deepcopy", lambda: _compare(before, _state(copy.deepcopy(model)), "deepcopy"))

    def torch_save():
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        return _compare(before, _state(torch.load(buf, weights_only=False)), "torch.save")
    _check(results, "torch_save", torch_save)
    _check(results, "state_unchanged", lambda: _compare(before, _state(model), "api_checks changed the model"))
    return results


def check_declared(arch: Arch, model: nn.Module) -> bool | str:
    """The Arch's metadata agrees with the built model (has_bn, non_persistent)."""
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats for m in model.modules())
    if has_bn != arch.has_bn:
        return f"has_bn declared {arch.has_bn}, model has {has_bn}"
    actual = tuple(non_persistent_buffers(model))
    if tuple(sorted(arch.non_persistent)) != actual:
        return f"non_persistent declared {sorted(arch.non_persistent)}, model has {list(actual)}"
    return True
