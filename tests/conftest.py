import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

# One intra-op thread: small test ops are dominated by thread wake-ups, and results stay
# deterministic whatever the machine.
torch.set_num_threads(1)

import pytest  # noqa: E402


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
