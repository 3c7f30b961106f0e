"""Session-wide real servers for the HTTP tests (helpers in tests/helpers.py): a tiny random
checkpoint with n-gram speculation, and the same checkpoint without a chat template."""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import API_KEY, RunningServer, start_server

MODEL = "tiny"


@pytest.fixture(scope="session")
def server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    running = start_server(tiny_model_dir, MODEL, API_KEY,
                           speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    yield running
    running.stop()


@pytest.fixture(scope="session")
def no_template_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The same checkpoint with its chat template removed."""
    model_dir = tmp_path_factory.mktemp("no-template") / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    running = start_server(model_dir, "plain", None)
    yield running
    running.stop()


@pytest.fixture()
def client(server: RunningServer) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c
