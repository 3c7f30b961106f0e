"""Server processes for side-by-side benchmarks: start one and wait until it is healthy,
send it JSON, and read the resident memory of it and its children from /proc."""
from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_bytes(pid: int) -> int:
    """Resident memory of a process and its descendants."""
    total = 0
    for proc in [pid, *descendants(pid)]:
        try:
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{proc}/status").read_text().splitlines())
        except (FileNotFoundError, ProcessLookupError):
            continue
        total += int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
    return total


def descendants(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue
    return children + [d for c in children for d in descendants(c)]


@contextmanager
def peak_rss(pid: int) -> Iterator[list[int]]:
    """Polls the resident memory of pid's tree while the block runs; yields [peak]."""
    peak, done = [rss_bytes(pid)], threading.Event()

    def poll() -> None:
        while not done.wait(0.05):
            peak[0] = max(peak[0], rss_bytes(pid))

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    try:
        yield peak
    finally:
        done.set()
        watcher.join()


def post_json(url: str, body: dict[str, Any], timeout: float = 1800) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return dict(json.loads(response.read()))


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was ready ({url})")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} was not ready within {timeout:.0f} s")


@dataclass
class Server:
    """A server process with how to send it one request: the request sends token ids and
    returns the count of output tokens."""

    label: str
    process: subprocess.Popen[bytes]
    send: Callable[[list[int]], int]
    idle_rss: int = 0


@contextmanager
def started(label: str, command: list[str], health: str, send: Callable[[list[int]], int], log_dir: Path,
            env: dict[str, str] | None = None) -> Iterator[Server]:
    """The server running `command` (its output in log_dir/<label>.log), once `health` answers."""
    log = (log_dir / f"{label.replace(' ', '-')}.log").open("w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_ready(health, process)
        time.sleep(2)  # let start-up work settle before the idle reading
        yield Server(label, process, send, rss_bytes(process.pid))
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()
