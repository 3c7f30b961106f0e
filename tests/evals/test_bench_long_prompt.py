"""bench_long_prompt on the tiny checkpoint: pacing cuts the long prompt into more steps,
each of which still gives the decoding streams a token."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdec.evals import bench_long_prompt


def test_paced_prefill_takes_more_steps(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench_long_prompt.main(["--model", str(tiny_model_dir), "--targets", "0,0.001", "--long-tokens", "300",
                            "--streams", "2", "--rounds", "1", "--max-num-batched-tokens", "512"])
    out = capsys.readouterr().out
    results = json.loads(out.strip().splitlines()[-1])
    unpaced, paced = results["0"][0], results["0.001"][0]
    assert unpaced["steps"] == 1  # the whole prompt in one step
    assert paced["steps"] > 2  # minimum chunks, a stream token each step
    assert "| prefill_step_target_ms |" in out
