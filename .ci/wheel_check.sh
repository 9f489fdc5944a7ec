#!/usr/bin/env bash
# Build the wheel, install it with torch alone (no DeepSpeed, transformers, Accelerate, NumPy) into a fresh venv,
# and use it from there: the core API, `zero-buffers list`, the checkpoint doctor on per-rank files, and one repro
# script shipped inside the package.
set -euo pipefail
cd "$(dirname "$0")/.."
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
.venv/bin/pip wheel -q --no-deps -w "$work/dist" .
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q torch==2.13.0 "$work"/dist/zero_buffers-*.whl
cd "$work"  # away from the source tree: everything below comes from the installed wheel
"$work/venv/bin/python" - <<'EOF'
import importlib.util
import pkgutil
import sys

import torch

import zero_buffers as zb

assert zb.__file__.startswith(sys.prefix), zb.__file__
wings = {m.name for m in pkgutil.iter_modules(zb.__path__) if m.ispkg}
assert wings == {"_compat", "_core", "bn", "doctor", "fsdp", "integrations", "precision", "training", "zero3"}, wings  # every wing shipped
report = zb.buffer_report(torch.nn.BatchNorm1d(3))
assert len(report.rows) == 3 and not report.checked
for missing in ("numpy", "deepspeed", "transformers", "accelerate"):
    assert importlib.util.find_spec(missing) is None, f"{missing} should not be installed here"
from torch.distributed.checkpoint import state_dict as dsd
original = dsd._load_model_state_dict
with zb.install():  # without DeepSpeed, transformers and Accelerate: torch's loads only
    assert zb.installed() and dsd._load_model_state_dict is not original
assert not zb.installed() and dsd._load_model_state_dict is original
try:
    zb.install(keep_precision=True)
except zb.DeepSpeedUnavailableError as e:
    print("install(keep_precision=True) without DeepSpeed:", e)
else:
    raise AssertionError("install(keep_precision=True) must need DeepSpeed")
print("core API from the wheel: ok")
EOF
listing="$("$work/venv/bin/zero-buffers" list)"
echo "$listing"
for name in buffers_diverge ddp_bn_checkpoint ema_codebook fsdp2_buffers zero3_load_buffers zero3_frozen_tokenizer zero3_frozen_hf_accelerate; do
  grep -q "^$name " <<<"$listing" || { echo "zero-buffers list misses $name"; exit 1; }
done
"$work/venv/bin/python" - <<'EOF'
import os
import torch
from torch import nn
os.mkdir("ranks")
for r in range(2):  # two ranks' files whose BatchNorm statistics diverged
    bn = nn.BatchNorm1d(3)
    bn(torch.randn(8, 3) + r)
    torch.save(bn.state_dict(), f"ranks/rank{r}.pt")
EOF
set +e; "$work/venv/bin/zero-buffers" diff ranks; code=$?; set -e
[ "$code" = 1 ] || { echo "zero-buffers diff should exit 1 on diverged ranks, got $code"; exit 1; }
"$work/venv/bin/zero-buffers" repair ranks -o fixed
"$work/venv/bin/zero-buffers" diff fixed
OMP_NUM_THREADS=1 "$work/venv/bin/zero-buffers" repro buffers_diverge --nproc 2 --timeout 300
echo "wheel check: ok"
