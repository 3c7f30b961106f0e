"""`specdec serve` on Ray Serve (--data-parallel-size N > 1, --ray-address, autoscaling):
start a local Ray cluster or join one, deploy the application (ray_app.py) behind Serve's
HTTP proxy on --host/--port, and stop it on SIGTERM/SIGINT.

The serve flags mean what they mean for one process, with three differences: the
per-replica flags are Serve's (replicas, CPUs, autoscaling); --shutdown-timeout is how
long a stopping replica's requests may go on (Serve's graceful_shutdown_timeout_s); and
the flags of the single process's own HTTP server and admission are refused (UNSUPPORTED),
since Serve's proxy and router take those jobs.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import ray
from ray import serve

from specdec.engine_args import engine_kwargs
from specdec.server.admission import resolve_api_key
from specdec.server.cors import cors_policy
from specdec.server.ray_app import Scaling, build_app
from specdec.server.state import server_limits, server_options
from specdec.server.tool_parsers import tool_call_settings

logger = logging.getLogger(__name__)
APP_NAME = "specdec"
# dest -> why Ray serving cannot honour it
UNSUPPORTED = {
    "max_concurrent_requests_per_key": "--max-concurrent-requests-per-key counts one process's requests; "
                                       "each replica would apply it on its own",
    "limit_concurrency": "--limit-concurrency sets the single-process HTTP server; Serve's proxy has its own",
    "timeout_header_read": "--timeout-header-read sets the single-process HTTP server; Serve's proxy has its own",
    "max_header_bytes": "--max-header-bytes sets the single-process HTTP server; Serve's proxy has its own",
}


def check_flags(args: argparse.Namespace, defaults: Mapping[str, Any]) -> None:
    """ValueError naming the first flag Ray serving cannot honour that is set."""
    for dest, reason in UNSUPPORTED.items():
        if getattr(args, dest) != defaults[dest]:
            raise ValueError(f"{reason}: it is not supported with --data-parallel-size, --ray-address or "
                             "autoscaling")


def scaling(args: argparse.Namespace) -> Scaling:
    return Scaling(num_replicas=args.data_parallel_size, min_replicas=args.min_replicas,
                   max_replicas=args.max_replicas, target_ongoing_requests=args.target_ongoing_requests)


def num_cpus_per_replica(args: argparse.Namespace) -> float:
    return 1.0 if args.num_cpus_per_replica is None else float(args.num_cpus_per_replica)


def application(args: argparse.Namespace, api_key: str | None) -> Any:
    """The Serve application of these serve flags."""
    return build_app({"model": args.model, **engine_kwargs(args)}, served_model_name=args.served_model_name,
                     scaling=scaling(args), num_cpus_per_replica=num_cpus_per_replica(args),
                     shutdown_timeout=args.shutdown_timeout, api_key=api_key,
                     docs_without_auth=args.docs_without_auth, limits=server_limits(args),
                     options=server_options(args), cors=cors_policy(args), tool_calls=tool_call_settings(args),
                     log_level=args.log_level)


def connect(args: argparse.Namespace) -> bool:
    """Join --ray-address, or start a local cluster; True when it started one."""
    if args.ray_address is not None:
        ray.init(address=args.ray_address, logging_level=args.log_level.upper())
        return False
    # No dashboard: it costs about 1 GiB of memory; start a cluster with `ray start --head`
    # and pass --ray-address to have it.
    ray.init(logging_level=args.log_level.upper(), include_dashboard=False)
    return True


def check_resources(args: argparse.Namespace, local: bool) -> None:
    """The replicas to start must fit the cluster's CPUs; a joined cluster may add nodes, so
    there it is only a warning."""
    needed = scaling(args).initial_replicas * num_cpus_per_replica(args)
    available = ray.cluster_resources().get("CPU", 0.0)
    if needed <= available:
        return
    message = (f"{scaling(args).initial_replicas} replicas × {num_cpus_per_replica(args):g} CPUs "
               f"(--data-parallel-size × --num-cpus-per-replica) need {needed:g} CPUs; the Ray cluster has "
               f"{available:g}")
    if local:
        raise ValueError(message)
    logger.warning("%s: replicas wait until the cluster has room", message)


def deploy(args: argparse.Namespace, api_key: str | None) -> str:
    """Serve's proxy on --host/--port and the application behind it, once its replicas
    are up; the URL."""
    serve.start(http_options={"host": args.host, "port": args.port, "keep_alive_timeout_s": args.timeout_keep_alive})
    serve.run(application(args, api_key), name=APP_NAME, route_prefix="/")
    return f"http://{args.host}:{args.port}"


def stop(local: bool) -> None:
    """Remove the application (its replicas drain first); a cluster we started goes too."""
    if not ray.is_initialized():
        return
    if local:
        serve.shutdown()
    else:
        serve.delete(APP_NAME)
    ray.shutdown()


def serve_replicas(args: argparse.Namespace, defaults: Mapping[str, Any]) -> None:
    """`specdec serve` on Ray: a start-up error is one line on stderr and exit code 2, as
    for one process (the traceback too with --log-level debug)."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("specdec").setLevel(args.log_level.upper())
    local = args.ray_address is None
    try:
        api_key = resolve_api_key(args.api_key, os.environ.get("SPECDEC_API_KEY"))
        check_flags(args, defaults)
        for check in (server_options, cors_policy, server_limits, tool_call_settings, scaling):
            check(args)  # a ValueError names the flag
        start = time.monotonic()
        local = connect(args)
        ray_ready = time.monotonic()
        check_resources(args, local)
        url = deploy(args, api_key)
    except Exception as exc:  # noqa: BLE001 - any start-up failure is reported as one line
        stop(local)
        if args.log_level == "debug":
            raise
        print(f"specdec serve: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    logger.info("serving %s at %s: Ray %s in %.1f s, replicas ready %.1f s later", args.served_model_name or
                args.model, url, "started" if local else "joined", ray_ready - start, time.monotonic() - ray_ready)
    wait_for_signal()
    logger.info("stopping: replicas finish their requests (up to --shutdown-timeout %g s)", args.shutdown_timeout)
    stop(local)


def wait_for_signal() -> None:
    """Until SIGTERM or SIGINT; a second one then ends the process at once (the default
    handlers are back), without waiting for the replicas to drain."""
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    while not stopping.wait(1.0):
        pass
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
