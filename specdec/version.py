"""The installed package's version, as `specdec --version` and GET /version report it."""
from __future__ import annotations

from importlib.metadata import version


def specdec_version() -> str:
    return version("specdec")
