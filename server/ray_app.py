"""The Ray Serve application: engine replicas behind one OpenAI endpoint.

    ingress (ray_ingress.py)  ─ prefix-aware router (ray_router.py) ─►  EngineReplica × N (ray_replica.py)
           └── GET /metrics ◄── MetricsBoard (ray_metrics.py) ◄── each replica's page

`build_app` makes it from Python; `app_builder` from `serve run`'s key=value arguments:

    serve run specdec.server.ray_app:app_builder model=DIR data_parallel_size=2 enable_prefix_caching=true

and `specdec serve --data-parallel-size N` runs it (ray_launch.py). Each replica asks Ray
for `num_cpus_per_replica` CPUs (and runs that many torch threads) and, where the engine
runs on CUDA, a GPU. With autoscaling (`Scaling`), Serve keeps each replica near
`target_ongoing_requests` requests in flight, between min and max replicas.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, get_type_hints

import ray
from ray import serve
from ray.serve import Application

from specdec.config import EngineConfig
from specdec.server.ray_ingress import Ingress
from specdec.server.ray_metrics import MetricsBoard
from specdec.server.ray_replica import EngineReplica, ReplicaSettings
from specdec.server.ray_router import DEFAULT_IMBALANCE_THRESHOLD, PrefixAffinityRouter

DEFAULT_TARGET_ONGOING_REQUESTS = 2.0  # Serve's own default
HEALTH_CHECK_PERIOD_S = 5.0
CONSTRUCTOR_RETRIES = 3  # a replica that cannot load its model fails the deployment after this many tries
INGRESS_MAX_ONGOING_REQUESTS = 4096  # HTTP requests one ingress replica holds at once


@dataclass(frozen=True)
class Scaling:
    """`num_replicas` engine replicas; with any of the other three set, autoscaled between
    `min_replicas` (default 1) and `max_replicas` (default: at least num_replicas),
    starting from num_replicas (brought inside those bounds)."""

    num_replicas: int = 2
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"--data-parallel-size must be at least 1, got {self.num_replicas}")
        if self.autoscaled and self.bounds[0] > self.bounds[1]:
            raise ValueError(f"--min-replicas ({self.bounds[0]}) is above --max-replicas ({self.bounds[1]})")

    @property
    def autoscaled(self) -> bool:
        return (self.min_replicas, self.max_replicas, self.target_ongoing_requests) != (None, None, None)

    @property
    def bounds(self) -> tuple[int, int]:
        low = 1 if self.min_replicas is None else self.min_replicas
        return low, self.max_replicas if self.max_replicas is not None else max(self.num_replicas, low)

    @property
    def initial_replicas(self) -> int:
        low, high = self.bounds if self.autoscaled else (self.num_replicas, self.num_replicas)
        return min(max(self.num_replicas, low), high)

    def deployment_options(self) -> dict[str, Any]:
        if not self.autoscaled:
            return {"num_replicas": self.num_replicas}
        low, high = self.bounds
        target = self.target_ongoing_requests or DEFAULT_TARGET_ONGOING_REQUESTS
        return {"autoscaling_config": {"min_replicas": low, "max_replicas": high,
                                       "initial_replicas": self.initial_replicas,
                                       "target_ongoing_requests": target}}


def build_app(engine_args: Mapping[str, Any], *, served_model_name: str | None = None,
              scaling: Scaling | None = None, num_cpus_per_replica: float = 1.0,
              num_gpus_per_replica: float | None = None, imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
              shutdown_timeout: float = 30.0, **app_settings: Any) -> Application:
    """The application over replicas of the engine `engine_args` describes (`model` and
    LLM keyword arguments). `app_settings` are ReplicaSettings fields (api_key, limits,
    options, cors, tool_calls, docs_without_auth, log_level, metrics_interval).
    num_gpus_per_replica None: one where the engine runs on CUDA."""
    engine_kwargs = dict(engine_args)
    model = engine_kwargs.pop("model", None)
    if not model:
        raise ValueError("engine_args needs a model")
    if not num_cpus_per_replica > 0:
        raise ValueError(f"--num-cpus-per-replica must be positive, got {num_cpus_per_replica}")
    scaling = scaling or Scaling()
    settings = ReplicaSettings(model=str(model), served_model_name=served_model_name or str(model),
                               engine_kwargs=engine_kwargs, num_threads=max(1, math.floor(num_cpus_per_replica)),
                               **app_settings)
    board = serve.deployment(name="MetricsBoard", num_replicas=1, ray_actor_options={"num_cpus": 0})(
        MetricsBoard).bind(stale_after=3 * settings.metrics_interval + 5.0)
    gpus = _gpus_per_replica(str(engine_kwargs.get("device", "auto"))) if num_gpus_per_replica is None \
        else num_gpus_per_replica
    options = engine_options(engine_kwargs, scaling, {"num_cpus": num_cpus_per_replica, "num_gpus": gpus},
                             imbalance_threshold, shutdown_timeout)
    engine = serve.deployment(**options)(EngineReplica).bind(settings, board)
    return serve.deployment(name="Ingress", num_replicas=1, ray_actor_options={"num_cpus": 0},
                            max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS)(
        Ingress).bind(engine, board, settings.limits.max_body_bytes)


def engine_options(engine_kwargs: Mapping[str, Any], scaling: Scaling, resources: dict[str, float],
                   imbalance_threshold: int, shutdown_timeout: float) -> dict[str, Any]:
    """The engine deployment's Serve options. A replica takes as many requests at once as
    its engine batches (max_num_seqs); more wait in the ingress, for whichever replica
    frees up first."""
    router = {"request_router_class": PrefixAffinityRouter,
              "request_router_kwargs": {"imbalance_threshold": imbalance_threshold}}
    return {"name": "EngineReplica", "ray_actor_options": resources,
            "max_ongoing_requests": int(engine_kwargs.get("max_num_seqs") or _engine_default("max_num_seqs")),
            "request_router_config": router, "health_check_period_s": HEALTH_CHECK_PERIOD_S,
            "graceful_shutdown_timeout_s": shutdown_timeout, "max_constructor_retry_count": CONSTRUCTOR_RETRIES,
            **scaling.deployment_options()}


def _gpus_per_replica(device: str) -> float:
    """A GPU for a CUDA engine; for `auto`, one when the cluster has GPUs."""
    if device == "cuda":
        return 1.0
    if device == "auto" and ray.is_initialized():
        return 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    return 0.0


def _engine_default(name: str) -> Any:
    return next(f.default for f in fields(EngineConfig) if f.name == name)


# ---- serve run --------------------------------------------------------------------------------

_DEPLOYMENT_ARGS = {"data_parallel_size": int, "min_replicas": int, "max_replicas": int,
                    "target_ongoing_requests": float, "num_cpus_per_replica": float, "served_model_name": str}


def app_builder(args: dict[str, Any]) -> Application:
    """For `serve run specdec.server.ray_app:app_builder key=value ...`: the keys of
    _DEPLOYMENT_ARGS, and engine options by their EngineConfig names (model, max_model_len,
    enable_prefix_caching, ...). An unknown key is refused."""
    engine = {key: engine_value(key, value) for key, value in args.items() if key not in _DEPLOYMENT_ARGS}
    deployment = {key: kind(args[key]) for key, kind in _DEPLOYMENT_ARGS.items() if key in args}
    scaling = Scaling(num_replicas=deployment.get("data_parallel_size", 2),
                      min_replicas=deployment.get("min_replicas"), max_replicas=deployment.get("max_replicas"),
                      target_ongoing_requests=deployment.get("target_ongoing_requests"))
    return build_app(engine, served_model_name=deployment.get("served_model_name"), scaling=scaling,
                     num_cpus_per_replica=deployment.get("num_cpus_per_replica", 1.0))


def engine_value(key: str, value: Any) -> Any:
    """A `serve run` argument (text, or a YAML value) as the engine option's type."""
    hints = get_type_hints(EngineConfig)
    if key not in hints:
        raise ValueError(f"unknown argument {key!r}: not an engine option nor one of {sorted(_DEPLOYMENT_ARGS)}")
    kind = hints[key]
    if kind is bool and isinstance(value, str):
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"{key} must be true or false, got {value!r}")
        return value.lower() in ("true", "1")
    return kind(value) if kind in (int, float) else value
