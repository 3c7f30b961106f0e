"""Compiles the C++ CPU kernels on first use and loads them with ctypes.

The library is built for the machine it runs on (-march=native) and cached under
$SPECDEC_HOME/kernels, keyed by the source and the headers beside it, the compiler and
flags, and the CPU's feature flags, so a home shared between machines never loads code
built for another CPU. $SPECDEC_CXXFLAGS adds flags after ours (e.g. `-mno-avx512f`
builds the 8-lane AVX2 code on an AVX-512 machine). Only a C++ compiler is needed (g++ by default, or $CXX): no
torch headers, so a build takes a second or two. OpenMP comes from the libgomp torch
already loaded.

A library is loaded only once it matches the size and sha256 in the manifest beside it
(`<library>.json`): calling into a truncated library would kill the process with SIGBUS.
A library that is damaged, or has no manifest, is rebuilt with one warning. Builds hold a
lock file per library, write to a temporary file and rename it into place, then write the
manifest the same way, so concurrent builders never load or clobber a partial file; a
builder holding the lock also removes what killed builds left behind.
"""
from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from specdec.kernels.disk_cache import PARTIAL_SUFFIX, file_record, mismatch, specdec_home, write_json_atomic

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC"]
# A temporary file no lock covers (another library's, or one from before lock files) is
# left alone until it is this old: a live build finishes in well under that.
STALE_SECONDS = 15 * 60


class KernelBuildError(RuntimeError):
    """The C++ kernels could not be compiled or loaded here."""


@functools.cache
def load(name: str) -> ctypes.CDLL:
    """csrc/<name>.cpp as a loaded library, compiled first if not cached or damaged."""
    library = build(name)
    try:
        return ctypes.CDLL(str(library))
    except OSError as error:
        raise KernelBuildError(f"cannot load {library}: {error}") from error


def build(name: str) -> Path:
    """The cached library of csrc/<name>.cpp, checked against its manifest; (re)built
    first if it is missing or does not match."""
    source = SOURCE_DIR / f"{name}.cpp"
    compiler = os.environ.get("CXX", "g++")
    flags = [*FLAGS, *os.environ.get("SPECDEC_CXXFLAGS", "").split()]
    library = specdec_home() / "kernels" / f"{name}-{_digest(source, compiler, flags)}.so"
    if _damage(library) is None:
        return library
    try:
        _rebuild(source, compiler, flags, library)
    except OSError as error:  # an unwritable cache, a compiler that cannot start
        raise KernelBuildError(f"cannot build {library}: {error}") from error
    return library


def function(name: str, symbol: str, argtypes: list[Any], restype: Any = None) -> Any:
    """The C function `symbol` of csrc/<name>.cpp, its ctypes signature set on first use."""
    c_function = getattr(load(name), symbol)
    if c_function.argtypes is None:
        c_function.argtypes = argtypes
        c_function.restype = restype
    return c_function


@functools.cache
def builds(name: str, fallback: str) -> bool:
    """Whether csrc/<name>.cpp builds and loads here, tried once per process; if it does
    not, one warning says that `fallback` is used instead."""
    try:
        load(name)
    except KernelBuildError as error:
        logger.warning("C++ kernel %s unavailable, using %s: %s", name, fallback, error)
        return False
    return True


def _digest(source: Path, compiler: str, flags: list[str]) -> str:
    headers = [header.read_bytes() for header in sorted(SOURCE_DIR.glob("*.h"))]
    parts = [source.read_bytes(), *headers, compiler.encode(), " ".join(flags).encode(),
             platform.machine().encode(), cpu_flags().encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def cpu_flags() -> str:
    """The CPU's feature flags line from /proc/cpuinfo (the processor name elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")


def _manifest(library: Path) -> Path:
    return library.with_name(library.name + ".json")


def _damage(library: Path) -> str | None:
    """What is wrong with the cached library: "" if it was never built, None if it
    matches its manifest, else what does not match."""
    manifest = _manifest(library)
    if not manifest.exists():
        return f"recorded by no manifest ({manifest.name} is missing)" if library.exists() else ""
    try:
        record = json.loads(manifest.read_text())
    except (OSError, ValueError) as error:
        return f"recorded by an unreadable manifest {manifest.name} ({error})"
    return mismatch(library, record)


def _rebuild(source: Path, compiler: str, flags: list[str], library: Path) -> None:
    if shutil.which(compiler) is None:
        raise KernelBuildError(f"no C++ compiler {compiler!r} on PATH (set CXX) to build {source.name}")
    library.parent.mkdir(parents=True, exist_ok=True)
    with _locked(library):
        _remove_stale_partials(library)
        damage = _damage(library)  # again: another builder may have finished while this one waited
        if damage is None:
            return
        if damage:
            logger.warning("cached kernel library %s is bad, rebuilding it: %s", library, damage)
        _compile(source, compiler, flags, library)
        write_json_atomic(_manifest(library), file_record(library))


@contextmanager
def _locked(library: Path) -> Iterator[None]:
    """Hold the library's build lock: released by the kernel even if this process is killed."""
    with open(library.with_name(library.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _remove_stale_partials(library: Path) -> None:
    """Delete temporary files of killed builds: this library's (its lock is held, so no live
    build writes them), and any other older than STALE_SECONDS."""
    old = time.time() - STALE_SECONDS
    for path in [*library.parent.glob(f"*{PARTIAL_SUFFIX}"), *library.parent.glob("tmp*.so")]:
        try:
            if path.name.startswith(library.name + ".") or path.stat().st_mtime < old:
                path.unlink()
        except FileNotFoundError:  # another builder removed it first
            pass


def _compile(source: Path, compiler: str, flags: list[str], library: Path) -> None:
    # Build beside the target and rename: concurrent first uses never load a partial file.
    fd, partial = tempfile.mkstemp(dir=library.parent, prefix=library.name + ".", suffix=PARTIAL_SUFFIX)
    os.close(fd)
    try:
        result = subprocess.run([compiler, *flags, str(source), "-o", partial], capture_output=True, text=True)
        if result.returncode != 0:
            raise KernelBuildError(f"{compiler} failed on {source.name}:\n{result.stderr[-4000:]}")
        os.replace(partial, library)
        logger.info("built %s", library)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
