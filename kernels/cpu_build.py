"""Compiles the C++ CPU kernels on first use and loads them with ctypes.

The library is built for the machine it runs on (-march=native) and cached under
$SPECDEC_HOME/kernels, keyed by the source and the headers beside it, the compiler and
flags, and the CPU's feature flags, so a home shared between machines never loads code
built for another CPU. $SPECDEC_CXXFLAGS adds flags after ours (e.g. `-mno-avx512f`
builds the 8-lane AVX2 code on an AVX-512 machine). Only a C++ compiler is needed (g++ by default, or $CXX): no
torch headers, so a build takes a second or two. OpenMP comes from the libgomp torch
already loaded.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from specdec.model_registry import specdec_home

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC"]


class KernelBuildError(RuntimeError):
    """The C++ kernels could not be compiled or loaded here."""


@functools.cache
def load(name: str) -> ctypes.CDLL:
    """csrc/<name>.cpp as a loaded library, compiled first if not cached."""
    source = SOURCE_DIR / f"{name}.cpp"
    compiler = os.environ.get("CXX", "g++")
    flags = [*FLAGS, *os.environ.get("SPECDEC_CXXFLAGS", "").split()]
    library = specdec_home() / "kernels" / f"{name}-{_digest(source, compiler, flags)}.so"
    if not library.exists():
        try:
            _compile(source, compiler, flags, library)
        except OSError as error:  # an unwritable cache, a compiler that cannot start
            raise KernelBuildError(f"cannot build {library}: {error}") from error
    try:
        return ctypes.CDLL(str(library))
    except OSError as error:
        raise KernelBuildError(f"cannot load {library}: {error}") from error


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


def _compile(source: Path, compiler: str, flags: list[str], library: Path) -> None:
    if shutil.which(compiler) is None:
        raise KernelBuildError(f"no C++ compiler {compiler!r} on PATH (set CXX) to build {source.name}")
    library.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent first uses never load a partial file.
    fd, partial = tempfile.mkstemp(suffix=".so", dir=library.parent)
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
