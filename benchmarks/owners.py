"""What finding the owners of a parameter list costs (GatheredParametersAndBuffers(params, modifier_rank=r)).

    python benchmarks/owners.py            # three heap sizes (about 0.3, 1 and 3.6 million objects), 400 modules
    python benchmarks/owners.py --quick    # one small heap: checks every output, claims nothing

One process (a world of one gloo rank, for DeepSpeed's zero.Init). The model is built under zero.Init; the heap
is grown with small dicts and lists (what a data pipeline or a tokenizer vocabulary leaves behind); the table
gives the objects the garbage collector tracks. Per heap size, the median over repeats of:

- ``gc.get_objects`` alone, then the whole heap search (every live module's registrations, indexed);
- ``list(model.parameters())``: the first call (it searches) and a later one (the index is kept until the next
  parameter or submodule registration anywhere);
- ``model.parameters()`` (the generator names its module: no search);
- DeepSpeed's per-module loading walk (one call per module with its own parameters) with the index kept, and with
  it dropped before every call (what each call would cost without it);
- a model built under ``zero_buffers.Init``, whose record knows every owner (no search): the whole list, and the
  per-module walk.

Writes ``results.json`` and ``results.md`` into the output folder (default ``benchmarks/results/owners``).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import zero_buffers as zb
from harness import init_deepspeed, machine, md_table, utc_now, write_json, zero3_config
from zero_buffers.zero3 import _owners


def median_seconds(fn: Callable[[], Any], repeats: int, before: Callable[[], Any] | None = None) -> float:
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def model(blocks: int) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)) for _ in range(blocks)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "owners")
    args = parser.parse_args(argv)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(prefix="zb_owners_"), 1), rank=0,
                            world_size=1)
    deepspeed = init_deepspeed(torch.device("cpu"))  # on the gloo group just made
    config = zero3_config()
    blocks = 20 if args.quick else 200
    repeats = 3 if args.quick else args.repeats
    with deepspeed.zero.Init(config_dict_or_path=config):
        net = model(blocks)
    with zb.Init(config_dict_or_path=config):
        recorded = model(blocks)
    zero = sorted((p for p in net.parameters()), key=lambda p: p.ds_id)
    given = {id(p) for p in zero}
    owners = [m for m in net.modules() if m._parameters]
    junk: list[Any] = []
    rows = []
    for grow in ((0,) if args.quick else (0, 1_000_000, 5_000_000)):
        junk += [{"k": [i], "t": (i, str(i))} for i in range((grow - len(junk) * 3) // 3)] if grow else []
        gc.collect()
        objects = len(gc.get_objects())

        def searched() -> _owners.Found:
            _owners._invalidate()
            return _owners.find(zero, given)

        found = searched()
        if [m for _, m in found.whole] != [net] or _owners.scans[0] == 0:
            raise AssertionError("the search did not find the model as the owner of all its parameters")
        walk_ids = [({id(p) for p in m._parameters.values()},
                     sorted(m._parameters.values(), key=lambda p: p.ds_id)) for m in owners]

        def walk() -> None:
            for ids, ps in walk_ids:
                _owners.find(ps, ids)

        def walk_uncached() -> None:
            for ids, ps in walk_ids:
                _owners._invalidate()
                _owners.find(ps, ids)

        rec_walk = [({id(p) for p in m._parameters.values()}, sorted(m._parameters.values(), key=lambda p: p.ds_id))
                    for m in recorded.modules() if m._parameters]

        def walk_recorded() -> None:
            for ids, ps in rec_walk:
                _owners.find(ps, ids)

        rec_zero = sorted(recorded.parameters(), key=lambda p: p.ds_id)
        rec_given = {id(p) for p in rec_zero}
        scans = _owners.scans[0]
        _owners.find(rec_zero, rec_given)
        walk_recorded()
        if _owners.scans[0] != scans:
            raise AssertionError("a model built under zero_buffers.Init needed a heap search")
        row = {
            "heap_objects": objects,
            "gc.get_objects": median_seconds(gc.get_objects, repeats),
            "list, first call (search)": median_seconds(searched, repeats),
            "list, later call (index kept)": median_seconds(lambda: _owners.find(zero, given), repeats,
                                                             before=lambda: _owners.find(zero, given)),
            "generator (names its module)": median_seconds(
                lambda: _owners.find(zero, given, root=(net, True)), repeats, before=_owners._invalidate),
            "zero_buffers.Init record": median_seconds(lambda: _owners.find(rec_zero, rec_given), repeats,
                                                       before=_owners._invalidate),
            f"per-module walk, {len(walk_ids)} calls, index kept": median_seconds(walk, max(1, repeats // 2),
                                                                                 before=_owners._invalidate),
            f"per-module walk, {len(rec_walk)} calls, zero_buffers.Init record": median_seconds(
                walk_recorded, max(1, repeats // 2), before=_owners._invalidate),
        }
        if args.quick or grow == 0:  # each call searching: only where the heap is small enough to wait for it
            row[f"per-module walk, {len(walk_ids)} calls, searching each"] = median_seconds(walk_uncached, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = {"when": utc_now(), "machine": machine(), "python": sys.version.split()[0],
            "torch": torch.__version__, "deepspeed": deepspeed.__version__, "quick": args.quick,
            "model": f"{blocks} x (Linear, BatchNorm1d) under zero.Init ({len(zero)} ZeRO parameters)"}
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "results.json", {"meta": meta, "rows": rows})
    keys = list(rows[0])
    lines = ["# Finding the owners of a parameter list", "",
             f"{meta['when']} on {meta['machine']}; Python {meta['python']}, torch {meta['torch']}, DeepSpeed "
             f"{meta['deepspeed']}; {meta['model']}; median of {repeats} (the walks: of {max(1, repeats // 2)}, "
             f"searching each: one run){' (quick mode: claims nothing)' if args.quick else ''}. Seconds.", "",
             *md_table(keys, [[f"{r[k]:.4f}" if isinstance(r.get(k), float) else str(r.get(k, "-")) for k in keys]
                              for r in rows])]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
