"""The hypothesis strategies (tests/strategies.py) can produce every case the property tests claim to cover: every
dtype, 0-dim, empty, non-contiguous, aliased, shared and ignored buffers, special floats and differing ranks; every
BatchNorm kind, dtype, untracked and counterless layers, counts all 0 and uneven. Guards against a silent narrowing."""
from __future__ import annotations

import math

from hypothesis import given

from tests.strategies import (
    BN_DTYPES,
    BN_KINDS,
    DTYPES,
    SPECIALS,
    bn_specs,
    bounded,
    tree_specs,
)


def test_the_strategies_can_produce_every_case():
    """The strategies can produce every case the properties claim to cover (guards against a silent narrowing)."""
    seen: set = set()

    @bounded(150)
    @given(spec=tree_specs(2))
    def collect(spec):
        for b in spec["buffers"]:
            seen.add(b["kind"])
            if b["kind"] == "tensor":
                seen.update({b["dtype"], ("persistent", b["persistent"]), ("ndim", len(b["shape"])),
                             ("empty", math.prod(b["shape"]) == 0), ("noncontig", b["noncontig"]),
                             ("special", b["special"]), ("differs", bool(b["differ"])), b["diff_kind"]})
        seen.update({("share", spec["share"] is not None), ("ignore", bool(spec["ignore"])),
                     ("atol", spec["atol"]), ("params", bool(spec["params"]))})

    collect()
    expected = set(DTYPES) | {"tensor", "none", "alias", "value", "signed_zero"} | \
        {("persistent", True), ("persistent", False), ("ndim", 0), ("ndim", 1), ("ndim", 2), ("ndim", 3),
         ("empty", True), ("empty", False), ("noncontig", True), ("share", True), ("ignore", True),
         ("atol", 0.0), ("atol", 0.5), ("atol", 100.0), ("params", True), ("differs", True),
         ("differs", False)} | {("special", s) for s in SPECIALS}
    assert expected <= seen, expected - seen

    bn_seen: set = set()

    @bounded(150)
    @given(spec=bn_specs(2))
    def collect_bn(spec):
        for s in spec["layers"]:
            bn_seen.update({("kind", s["kind"]), ("dtype", s["dtype"]), ("track", s["track"]),
                            ("counter", s["counter"]), ("nested", s["nested"])})
            if s["track"] and s["counter"]:
                bn_seen.add(("all counts 0", sum(s["counts"]) == 0))
                bn_seen.add(("uneven counts", len(set(s["counts"])) > 1))

    collect_bn()
    bn_expected = {("kind", k) for k in BN_KINDS} | {("dtype", d) for d in BN_DTYPES} | \
        {(f, v) for f in ("track", "counter", "nested", "all counts 0", "uneven counts") for v in (True, False)}
    assert bn_expected <= bn_seen, bn_expected - bn_seen
