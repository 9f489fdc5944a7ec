"""Point 3 of [Note: uninitialised buffers] element by element (``_core/compare.Leftover``), in one process: which
values look like memory nobody wrote, against the reference's copy, in each floating dtype, fed in blocks."""
from __future__ import annotations

import math

import pytest
import torch

from zero_buffers._compat import torch as torch_compat
from zero_buffers._core import compare

REF = torch.tensor([0.5, 1.0, 2.0, 0.25])


def _found(x: torch.Tensor, ref: torch.Tensor, blocks: int = 1) -> bool:
    seen = compare.Leftover()
    for a, b in zip(x.chunk(blocks), ref.chunk(blocks)):
        seen.add(a, b)
    return seen.found


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("value,leftover", [
    (math.nan, True), (math.inf, True), (-math.inf, True),
    ("subnormal", True), (2.0 ** 65, True),
    (3.0, False), (-7.5, False), (0.0, False), (1e-3, False),
])
def test_one_leftover_looking_element_where_the_reference_holds_a_plain_number(dtype, value, leftover):
    x = REF.to(dtype).clone()
    if value == "subnormal":
        x[1] = torch.finfo(dtype).tiny / 4
    else:
        x[1] = value
    if dtype is torch.float16 and value == 2.0 ** 65:
        leftover = True  # float16 holds 2**65 as inf
    assert _found(x, REF.to(dtype)) is leftover


def test_the_same_special_value_in_the_reference_at_that_place_is_not_leftover():
    ref = torch.tensor([0.5, math.nan, 1e-42, 2.0 ** 70])
    assert not _found(ref.clone(), ref)
    assert not _found(torch.tensor([1.0, math.nan, 1e-42, 2.0 ** 70]), ref)  # only element 0 differs: a plain value
    assert _found(torch.tensor([math.nan, 0.0, 0.0, 0.0]), ref)  # NaN where the reference has 0.5


def test_all_zero_against_a_reference_that_is_not_counts_over_every_block():
    assert _found(torch.zeros(8), torch.arange(8.0), blocks=4)
    assert not _found(torch.tensor([0.0, 0.0, 0.0, 1.0]), torch.ones(4), blocks=2)  # a non-zero in the last block
    assert not _found(torch.zeros(4), torch.zeros(4))  # zero where the reference is zero too


def test_a_reference_held_as_integers_holds_plain_numbers():
    assert _found(torch.tensor([1.0, 1e-42, 3.0]), torch.tensor([1, 2, 3]))
    assert not _found(torch.tensor([1.0, 2.5, 3.0]), torch.tensor([1, 2, 3]))
    assert not _found(torch.tensor([0.0, 1.0]), torch.tensor([True, False]))


def test_complex_buffers_count_their_parts_and_a_complex_against_a_real_one_is_not_judged():
    ref = torch.tensor([1 + 1j, 2 - 1j], dtype=torch.complex64)
    x = ref.clone()
    x[0] = complex(1.0, 1e-42)
    assert _found(x, ref)
    assert not _found(ref.clone() * 2, ref)
    assert not _found(torch.zeros(2, dtype=torch.complex64), ref.real.clone())


def test_a_version_counter_of_zero_means_never_written_in_place_and_inference_tensors_never_qualify():
    t = torch.empty(4)
    assert torch_compat.never_written(t)
    assert torch_compat.never_written(torch.zeros(3)) and torch_compat.never_written(torch.arange(3.0) * 2)
    t.copy_(REF)
    assert not torch_compat.never_written(t)
    bn = torch.nn.BatchNorm1d(4)
    bn(torch.randn(8, 4))
    assert not torch_compat.never_written(bn.running_mean)  # a BatchNorm forward writes its statistics
    with torch.inference_mode():
        frozen = torch.zeros(2)
    assert not torch_compat.never_written(frozen)
