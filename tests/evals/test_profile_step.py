"""profile_step on the tiny checkpoint: prefill and decode split per level, kernel timers
that count and then step aside."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from specdec.evals import profile_step as profile
from specdec.kernels import linear_cpu


def test_profile_splits_prefill_from_decode(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["profile_step", "--model", str(tiny_model_dir), "--categories", "qa",
                                      "--concurrency", "3", "--max-tokens", "5", "--max-model-len", "1024"])
    one, many = profile.main()
    assert (one["level"], one["steps"]) == (1, 3 * 4)  # three waves of one request, 4 tokens after the first
    assert (many["level"], many["steps"]) == (3, 4)
    for row in (one, many):
        # Two separately timed runs: on a shared machine either may come out longer.
        assert row["prefill"] > 0 and row["wall"] > 0
        assert all(f"decode_{name}_ms" in row for name in profile.KERNELS)
    assert "level 3 / level 1:" in capsys.readouterr().out


@pytest.mark.skipif(not linear_cpu.builds(), reason="the C++ linear kernel does not build here")
def test_kernel_timers_count_calls_and_restore_the_kernels() -> None:
    original = linear_cpu.linear_fp16
    weight = torch.randn(32, 16)
    with profile.kernel_timers() as seconds:
        linear_cpu.linear_fp16(torch.randn(2, 16), linear_cpu.pack_fp16(weight), None, 32)
    assert seconds["linears"] > 0 and seconds["attention"] == 0
    assert linear_cpu.linear_fp16 is original
