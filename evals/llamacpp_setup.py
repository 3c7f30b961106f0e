"""llama.cpp for the side-by-side benchmark (evals/bench_llamacpp.py), built from source:
llama-cpp-python in a venv of its own under build/llamacpp-venv (never the project's venv,
never in CI), and llama.cpp's own `llama-server` from the sources that llama-cpp-python's
sdist vendors. -march=native; minutes the first time on 2 cores; logs under build/."""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build"
VENV = BUILD / "llamacpp-venv"
SERVER_BUILD = BUILD / "llamacpp-server"
REQUIREMENT = "llama-cpp-python==0.3.36"
BUILD_TIMEOUT_S = 3 * 3600
# For this CPU (-march=native), no network at build time (no curl, no web UI download), and
# only the library the Python package loads (no multimodal library, tests or tools).
CMAKE_FLAGS = ["-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAVA_BUILD=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF",
               "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF"]
# llama-server alone: the server needs the tools tree, but not the others' binaries.
SERVER_CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                      "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON",
                      "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF"]


def note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def llamacpp_python(requirement: str, jobs: int) -> Path:
    """The python of the venv with llama-cpp-python, created and installed on first use."""
    python = VENV / "bin" / "python"
    check = [str(python), "-c", "import llama_cpp"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    log = BUILD / "llamacpp-install.log"
    note(f"installing {requirement} into {VENV} (builds llama.cpp from source; log: {log})")
    venv.create(VENV, with_pip=True, clear=True)
    env = os.environ | {"CMAKE_ARGS": " ".join(CMAKE_FLAGS), "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs),
                        "PIP_NO_INPUT": "1"}
    command = [str(python), "-m", "pip", "install", "-v", "--timeout", "60", "--no-binary", "llama-cpp-python",
               requirement]
    with log.open("w") as out:
        subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, check=True, timeout=BUILD_TIMEOUT_S)
    return python


def llamacpp_version(python: Path) -> str:
    done = subprocess.run([str(python), "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True,
                          text=True, check=True)
    return done.stdout.strip()


def llama_server(python: Path, jobs: int) -> Path:
    """llama-server built from the llama.cpp that the installed llama-cpp-python vendors
    (its sdist, fetched again from PyPI), built on first use."""
    binary = SERVER_BUILD / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    version = llamacpp_version(python)
    source = vendored_llamacpp(version)
    log = BUILD / "llama-server.log"
    note(f"building llama-server from {source} (log: {log})")
    build_dir = SERVER_BUILD / "build"
    with log.open("w") as out:
        for command in (["cmake", "-S", str(source), "-B", str(build_dir), *SERVER_CMAKE_FLAGS],
                        ["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)]):
            subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=True, timeout=BUILD_TIMEOUT_S)
    return binary


def vendored_llamacpp(version: str) -> Path:
    """vendor/llama.cpp of llama-cpp-python's sdist of this version, unpacked under build/."""
    unpacked = SERVER_BUILD / f"llama_cpp_python-{version}"
    if (unpacked / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
        return unpacked / "vendor" / "llama.cpp"
    SERVER_BUILD.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--timeout", "60",
                    "-d", str(SERVER_BUILD), f"llama-cpp-python=={version}"], check=True, timeout=1800)
    with tarfile.open(SERVER_BUILD / f"llama_cpp_python-{version}.tar.gz") as sdist:
        sdist.extractall(SERVER_BUILD, filter="data")
    return unpacked / "vendor" / "llama.cpp"
