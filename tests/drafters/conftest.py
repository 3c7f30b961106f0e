from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_eagle3_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """A random EAGLE-3 head in the published layout for the tiny target (tests/fixtures.py)."""
    from tests.fixtures import make_eagle3_head

    return make_eagle3_head(tmp_path_factory.mktemp("tiny-eagle3"), tiny_model_dir)
