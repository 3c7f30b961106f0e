import os
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

# One intra-op thread: small test ops are dominated by thread wake-ups, and results stay
# deterministic whatever the machine.
torch.set_num_threads(1)

import pytest  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`cuda`-marked tests need a GPU: skipped, saying so, where torch sees none."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; torch sees none")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


_has_cuda = torch.cuda.is_available
# CUDA_VISIBLE_DEVICES as the session found it: the fixtures below must leave it so, or the
# `cuda` tests would see no device (tests/test_conftest.py checks).
VISIBLE_AT_START = os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.fixture(autouse=True, scope="session")
def cpu_engine() -> Iterator[None]:
    """The tests are about the CPU engine unless marked `cuda`: on a GPU host
    `device="auto"` would otherwise pick CUDA, where the CPU-only options they use are
    refused. Session-wide, so module fixtures' engines see it too. Only torch's answer is
    patched, never CUDA_VISIBLE_DEVICES: hiding the GPU from the process would hide it from
    the `cuda` tests as well. Servers started in subprocesses are told `--device cpu`
    instead (tests/helpers.py: CPU_DEVICE)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: False)
        yield


@pytest.fixture(autouse=True)
def gpu_for_cuda_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("cuda") is not None:
        monkeypatch.setattr(torch.cuda, "is_available", _has_cuda)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.fixtures import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.fixtures import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("tiny-draft"), seed=1, num_layers=1)


@pytest.fixture(scope="session")
def tiny_medusa_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    from tests.fixtures import make_medusa_heads

    return make_medusa_heads(tmp_path_factory.mktemp("tiny-medusa"), tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_recurrent_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    from tests.fixtures import make_recurrent_heads

    return make_recurrent_heads(tmp_path_factory.mktemp("tiny-recurrent"), tiny_model_dir)
