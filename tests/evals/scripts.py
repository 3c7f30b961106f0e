"""Loading the scripts under evals/ (not a package on the path) as modules."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

EVALS = Path(__file__).parents[2] / "evals"


def load_eval(name: str) -> Any:
    """evals/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(name, EVALS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module: Any = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
