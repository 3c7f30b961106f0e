"""tests/conftest.py keeps the unmarked tests on the CPU engine without hiding the GPU from
the test process, so that the `cuda` tests of the same session still see it."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests import conftest, helpers
from tests.helpers import CPU_DEVICE


def test_the_session_leaves_cuda_visible_devices_as_it_found_it() -> None:
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == conftest.VISIBLE_AT_START


def test_unmarked_tests_see_no_gpu() -> None:
    assert torch.cuda.is_available() is False


def test_serve_children_are_told_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `specdec serve` child does not inherit the test's patched torch: its command says
    the device."""
    commands: list[list[str]] = []

    def record(command: list[str], **kwargs: object) -> None:
        commands.append(command)
        raise OSError("recorded, not started")

    monkeypatch.setattr(helpers.subprocess, "Popen", record)
    with pytest.raises(OSError, match="recorded"):
        helpers.start_serve_process(tmp_path, tmp_path / "serve.log", "--max-model-len", "64")
    at = commands[0].index("--device")
    assert tuple(commands[0][at:at + 2]) == CPU_DEVICE


@pytest.mark.cuda
def test_cuda_tests_see_the_gpu() -> None:
    assert torch.cuda.is_available() and torch.cuda.device_count() >= 1
    assert torch.ones(2, device="cuda").sum().item() == 2.0  # was "Invalid device id" under CUDA_VISIBLE_DEVICES=""


def test_no_test_module_overrides_an_explicit_triton_interpret() -> None:
    """`TRITON_INTERPRET=0 pytest -m cuda tests` must compile the kernels: a module that set
    the variable to 1 at import made every kernel decorated after it interpreted, and the
    `cuda` tests skip or crawl. Modules set it with setdefault (tests/conftest.py too)."""
    assignment = "os.environ[" + '"TRITON_INTERPRET"] ='  # split so that this file does not match
    forced = [str(path) for path in Path(__file__).parent.rglob("*.py") if assignment in path.read_text()]
    assert forced == []
