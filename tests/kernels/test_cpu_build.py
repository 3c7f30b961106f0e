"""The kernel cache (kernels/cpu_build.py) survives damage: a truncated, zero-filled or
unrecorded library is rebuilt with one warning before it is loaded (issue 23, defect 1),
stale temporary files of killed builds are removed, and concurrent builders do not clash.

A one-function stand-in source takes the place of csrc/ so builds take a fraction of a
second. Each test damages a copy of a cache in a second home: the first copy is loaded in
this process, and damaging a loaded library in place would crash it (dlopen also hands
back the loaded library for a path it has already opened).
"""
from __future__ import annotations

import ctypes
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from specdec import SamplingParams
from specdec.kernels import cpu_build
from specdec.llm import LLM

STAND_IN = 'extern "C" int specdec_stand_in(int x) { return x + 1; }\n'
ENGINE_KERNELS = ("paged_attention", "store_kv", "rms_norm")  # what the tiny checkpoint's engine loads


def _stand_in_works() -> bool:
    library = cpu_build.load("stand_in")
    return bool(library.specdec_stand_in(ctypes.c_int(41)) == 42)


def _copy_libraries(libraries: list[Path], kernels: Path) -> None:
    """Libraries (and their manifests, where they have one) into another cache's kernels folder."""
    kernels.mkdir(parents=True, exist_ok=True)
    for library in libraries:
        for path in (library, Path(f"{library}.json")):
            if path.is_file():
                shutil.copy2(path, kernels / path.name)


def _loaded_path(name: str) -> Path:
    """The file of csrc/<name>.cpp's library, loaded (and built if needed) in the current home."""
    return Path(cpu_build.load(name)._name)


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_build: None) -> Path:
    """The stand-in built in a first home, that cache copied into a second home that is now
    SPECDEC_HOME: returns the second home's kernels folder."""
    source_dir = tmp_path / "csrc"
    source_dir.mkdir()
    (source_dir / "stand_in.cpp").write_text(STAND_IN)
    monkeypatch.setattr(cpu_build, "SOURCE_DIR", source_dir)
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "first"))
    assert _stand_in_works()
    kernels = tmp_path / "second" / "kernels"
    _copy_libraries([_loaded_path("stand_in")], kernels)
    cpu_build.load.cache_clear()
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "second"))
    return kernels


def _library(kernels: Path, name: str = "stand_in") -> Path:
    (library,) = [p for p in kernels.glob(f"{name}-*.so") if p.is_file()]
    return library


def _truncate(library: Path) -> None:
    library.write_bytes(library.read_bytes()[: library.stat().st_size // 2])


def _zero_fill(library: Path) -> None:
    library.write_bytes(bytes(library.stat().st_size))


def _drop_manifest(library: Path) -> None:
    Path(f"{library}.json").unlink(missing_ok=True)


def _garble_manifest(library: Path) -> None:
    Path(f"{library}.json").write_text("{not json")


def _cache_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == cpu_build.__name__]


@pytest.mark.parametrize(("damage", "reason"), [
    (_truncate, "bytes"), (_zero_fill, "sha256"), (_drop_manifest, "manifest"), (_garble_manifest, "manifest"),
])
def test_damaged_library_is_rebuilt_with_one_warning(
        stand_in: Path, caplog: pytest.LogCaptureFixture, damage: Callable[[Path], None], reason: str) -> None:
    library = _library(stand_in)
    good = library.read_bytes()
    damage(library)
    with caplog.at_level(logging.INFO, logger=cpu_build.__name__):
        assert _stand_in_works()
    (warning,) = _cache_warnings(caplog)
    assert library.name in warning and reason in warning
    assert library.stat().st_size == len(good)
    assert Path(f"{library}.json").is_file()


def test_intact_library_is_loaded_without_a_build(stand_in: Path, caplog: pytest.LogCaptureFixture,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("an intact library was rebuilt")
    monkeypatch.setattr(cpu_build.subprocess, "run", refuse)
    with caplog.at_level(logging.INFO, logger=cpu_build.__name__):
        assert _stand_in_works()
    assert not _cache_warnings(caplog)


def test_deleted_library_with_a_manifest_is_rebuilt_with_a_warning(stand_in: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    library = _library(stand_in)
    library.unlink()
    with caplog.at_level(logging.INFO, logger=cpu_build.__name__):
        assert _stand_in_works()
    (warning,) = _cache_warnings(caplog)
    assert library.name in warning and "missing" in warning


def test_stale_temporary_files_are_removed(stand_in: Path, caplog: pytest.LogCaptureFixture) -> None:
    library = _library(stand_in)
    library.unlink()
    _drop_manifest(library)  # as a build killed before its rename leaves the cache
    an_hour_ago = time.time() - 3600
    killed = [stand_in / f"{library.name}.x1y2z3.partial", stand_in / "tmp_abc123.so",
              stand_in / "other-0123.so.json.q9.partial"]
    for path in killed:
        path.write_bytes(b"")
        os.utime(path, (an_hour_ago, an_hour_ago))
    in_progress = stand_in / "other-0123.so.k7.partial"  # another library's live build
    in_progress.write_bytes(b"")
    with caplog.at_level(logging.INFO, logger=cpu_build.__name__):
        assert _stand_in_works()
    assert [p for p in killed if p.exists()] == []
    assert in_progress.exists()
    assert not _cache_warnings(caplog)  # a first build is no damage


def test_concurrent_builders_compile_once(tmp_path: Path, stand_in: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "third"))
    compiles = []
    run = cpu_build.subprocess.run

    def counting_run(*args: object, **kwargs: object) -> object:
        compiles.append(args)
        time.sleep(0.2)  # the other builder arrives while this one compiles
        return run(*args, **kwargs)  # type: ignore[call-overload]
    monkeypatch.setattr(cpu_build.subprocess, "run", counting_run)
    builders = [threading.Thread(target=cpu_build.load, args=("stand_in",)) for _ in range(2)]
    for builder in builders:
        builder.start()
    for builder in builders:
        builder.join()
    assert len(compiles) == 1
    assert _stand_in_works()


def test_engine_generates_after_its_kv_store_kernel_is_truncated(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_build: None,
        caplog: pytest.LogCaptureFixture) -> None:
    libraries = [_loaded_path(name) for name in ENGINE_KERNELS]  # in the default cache, as other tests use it
    kernels = tmp_path / "kernels"
    _copy_libraries(libraries, kernels)
    # The old code built this engine, then died of SIGBUS on its first step. store_kv stands
    # for the three: any truncated library did that, and it rebuilds in half a second.
    library = libraries[ENGINE_KERNELS.index("store_kv")]
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    cpu_build.load.cache_clear()
    cpu_build.builds.cache_clear()
    _truncate(kernels / library.name)
    with caplog.at_level(logging.INFO, logger=cpu_build.__name__):
        llm = LLM(str(tiny_model_dir), max_model_len=128, attention_backend="cpp")
        out = llm.generate(["The quick brown fox"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert llm.engine.model.attention_backend.name == "cpp"
    assert len(out[0].outputs[0].token_ids) == 8
    assert [w for w in _cache_warnings(caplog) if library.name in w] != []
    assert (kernels / library.name).read_bytes() == library.read_bytes()
