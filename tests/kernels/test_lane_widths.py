"""Both vector widths of the C++ kernels pass their tests: the build here (16 lanes with
AVX-512, 8 without) runs in the rest of the suite, and on an AVX-512 machine this test
reruns the kernel tests on a build without it, the width an AVX2 machine gets."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.kernels import cpu_build

ROOT = Path(__file__).resolve().parents[2]
KERNEL_TESTS = ["tests/kernels/test_linear_cpu.py", "tests/kernels/test_attention_cpu.py",
                "tests/kernels/test_rms_norm_cpu.py"]


def _narrow_env() -> dict[str, str]:
    return {**os.environ, "SPECDEC_CXXFLAGS": "-mno-avx512f"}


@pytest.mark.skipif("avx512f" not in cpu_build.cpu_flags().split(), reason="this build is already 8 lanes")
def test_kernels_built_without_avx512_pass_their_tests() -> None:
    tile = subprocess.run([sys.executable, "-c", "from specdec.kernels import linear_cpu; print(linear_cpu.tile())"],
                          env=_narrow_env(), cwd=ROOT, capture_output=True, text=True, check=True)
    assert tile.stdout.strip() == "8"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS],
                         env=_narrow_env(), cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-4000:]
