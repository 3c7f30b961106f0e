from __future__ import annotations

from collections.abc import Iterator

import pytest

from specdec.kernels import cpu_build


@pytest.fixture
def fresh_build() -> Iterator[None]:
    """The C++ build and availability caches empty for this test, and again after it."""
    def clear() -> None:
        cpu_build.load.cache_clear()
        cpu_build.builds.cache_clear()
    clear()
    yield
    clear()
