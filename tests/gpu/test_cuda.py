"""The CUDA checks (tests/gpu/check_cuda.py) as a test: collected everywhere, skipped without a CUDA device."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device "
                                                   "(run tests/gpu/run.sh on a machine with one GPU)")]


def test_cuda_paths_on_two_gloo_ranks_sharing_one_gpu():
    script = Path(__file__).with_name("check_cuda.py")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "FAIL" not in out.stdout
