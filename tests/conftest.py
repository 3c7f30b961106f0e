import os

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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from tests.fixtures import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from tests.fixtures import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("tiny-draft"), seed=1, num_layers=1)


@pytest.fixture(scope="session")
def tiny_medusa_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir):  # type: ignore[no-untyped-def]
    from tests.fixtures import make_medusa_heads

    return make_medusa_heads(tmp_path_factory.mktemp("tiny-medusa"), tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_recurrent_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir):  # type: ignore[no-untyped-def]
    from tests.fixtures import make_recurrent_heads

    return make_recurrent_heads(tmp_path_factory.mktemp("tiny-recurrent"), tiny_model_dir)
