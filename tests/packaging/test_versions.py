"""The declared version ranges are the ones CI runs, and docs/versions.md's per-version claims hold on this stack.

.ci/run runs this file on the newest pins and the oldest supported versions, and its torch_next tests on torch 2.15.0.
"""
from __future__ import annotations

import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version
from torch import nn

import zero_buffers as zb
from tests.helpers import ZERO3_CONFIG, init_deepspeed

# the tests of what DeepSpeed, transformers and Accelerate do: run on both dependency stacks (.ci/run)
pytestmark = pytest.mark.stack

ROOT = Path(__file__).resolve().parents[2]
STACKS = ("constraints.txt", "constraints-oldest.txt", "constraints-torch-next.txt")  # what .ci/run installs


def _pins(name: str) -> dict[str, str]:
    return dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (ROOT / name).read_text(), re.M))


def test_pyproject_floors_are_the_oldest_stack_ci_runs():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floors = {}
    for spec in project["dependencies"] + project["optional-dependencies"]["all"]:
        m = re.match(r"([A-Za-z0-9_.-]+)>=([^,\s]+)", spec)
        if m:
            floors[m[1]] = m[2]
    oldest, newest = _pins("constraints-oldest.txt"), _pins("constraints.txt")
    for package in ("torch", "deepspeed", "accelerate", "transformers"):
        assert Version(floors[package]) == Version(oldest[package]) or (
            package == "transformers" and Version(oldest[package]).release[:2] == Version(floors[package]).release[:2]
        ), (package, floors[package], oldest[package])
        assert Version(newest[package]) >= Version(oldest[package])


@pytest.mark.torch_next
def test_this_stack_is_one_ci_runs():
    installed = {p: version(p) for p in ("deepspeed", "accelerate", "transformers")}
    installed["torch"] = Version(torch.__version__).public  # 2.15.0+cu132 is the pin 2.15.0
    stacks = [{p: v for p, v in _pins(f).items() if p in installed} for f in STACKS]
    assert installed in stacks, (installed, stacks)


@pytest.mark.torch_next
def test_the_declared_torch_range_starts_at_the_oldest_pin_and_refuses_no_newer_release():
    # no cap: a user who installs today gets the newest torch, and the newest stack CI runs is that release
    # (pip install -e . beside torch 2.15.0 must keep it)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_req = next(Requirement(d) for d in project["dependencies"] if Requirement(d).name == "torch")
    pins = sorted({Version(_pins(f)["torch"]) for f in STACKS})
    assert len(pins) >= 2, pins  # a second torch besides the floor
    assert all(p in torch_req.specifier for p in pins), (str(torch_req), pins)
    floor, newest = pins[0], pins[-1]
    assert Version(f"{floor.major}.{floor.minor}") in torch_req.specifier  # the floor is the oldest minor CI runs
    assert Version(f"{floor.major}.{floor.minor - 1}.99") not in torch_req.specifier
    assert newest >= Version("2.15.0")  # the newest release on the index when this was written
    assert all(s.operator == ">=" for s in torch_req.specifier), str(torch_req)  # nothing newer is refused
    assert Version(f"{newest.major}.{newest.minor + 5}") in torch_req.specifier


class _Net(nn.Module):
    def __init__(self, config=None):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)


def _from_pretrained(rank, world, path, fixed):
    from transformers import PretrainedConfig, PreTrainedModel
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    init_deepspeed()

    class VersionsConfig(PretrainedConfig):
        model_type = "zb_versions"

    class VersionsModel(PreTrainedModel):
        config_class = VersionsConfig

        def __init__(self, config):
            super().__init__(config)
            self.net = _Net()
            self.post_init()

    if rank == 0:
        torch.manual_seed(3)
        ref = VersionsModel(VersionsConfig())
        with torch.no_grad():
            ref.net.bn.running_mean.copy_(torch.arange(4.0) + 1)
            ref.net.bn.num_batches_tracked.fill_(9)
        ref.save_pretrained(path)
    torch.distributed.barrier()
    keep = HfDeepSpeedConfig(ZERO3_CONFIG)  # noqa: F841 - transformers holds a weakref: ZeRO-3 is on
    try:
        if fixed:
            with zb.install():
                model = VersionsModel.from_pretrained(path)
        else:
            model = VersionsModel.from_pretrained(path)
    finally:
        unset_hf_deepspeed_config()
    return model.net.bn.running_mean.clone(), int(model.net.bn.num_batches_tracked)


def test_from_pretrained_under_zero3_loads_checkpoint_buffers_as_documented(ranks2, tmp_path):
    want = torch.arange(4.0) + 1
    every_rank = Version(version("transformers")) >= Version("5.6.0")  # docs/versions.md
    plain = ranks2.run(_from_pretrained, str(tmp_path / "a"), False, timeout=120)
    assert torch.equal(plain[0][0], want) and plain[0][1] == 9
    assert torch.equal(plain[1][0], want) == every_rank, (version("transformers"), plain[1])
    fixed = ranks2.run(_from_pretrained, str(tmp_path / "b"), True, timeout=120)
    assert all(torch.equal(mean, want) and count == 9 for mean, count in fixed)
