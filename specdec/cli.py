"""`specdec serve | generate | models pull | eval` — the command line, vLLM style."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from specdec.engine_args import HELP_FORMAT, add_engine_args, engine_kwargs
from specdec.model_registry import KNOWN_MODELS, pull
from specdec.version import specdec_version

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _generate(args: argparse.Namespace) -> None:
    from specdec.llm import LLM
    from specdec.sampling_params import SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.sampling_seed)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    print(out.outputs[0].text)
    if llm.engine.config.speculative_config is not None:
        print(json.dumps(llm.get_metrics()), file=sys.stderr)


def _pull(args: argparse.Namespace) -> None:
    print(pull(args.name, force=args.force))


def _serve(args: argparse.Namespace) -> None:
    if _uses_ray(args):
        from specdec.server.ray_launch import serve_replicas

        serve_replicas(args, vars(build_parser().parse_args(["serve"])))
        return
    from specdec.server.app import serve

    serve(args)


def load_eval(name: str) -> ModuleType | None:
    """`specdec.evals.<name>`, or evals/<name>.py of the source tree when the installed
    package has no `specdec.evals` yet (an editable install made before that mapping)."""
    try:
        return importlib.import_module(f"specdec.evals.{name}")
    except ModuleNotFoundError as error:
        if error.name not in ("specdec.evals", f"specdec.evals.{name}"):
            raise
    path = Path(__file__).resolve().parent.parent / "evals" / f"{name}.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location(f"_specdec_evals_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up in sys.modules
    spec.loader.exec_module(module)
    return module


def _add_eval(sub: Any) -> None:
    acceptance = load_eval("eval_acceptance")
    if acceptance is None:
        return
    evals = sub.add_parser("eval", help="evaluations").add_subparsers(dest="eval", required=True)
    acc = evals.add_parser("acceptance", help="acceptance rate, τ and speedup of speculative configs")
    acceptance.add_arguments(acc)
    acc.set_defaults(func=acceptance.main)


def _at_least(minimum: float, kind: type[int] | type[float] = int) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if not value >= minimum:  # also refuses nan
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its "invalid ... value" message
    return parse


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _add_access_args(serve: argparse.ArgumentParser) -> None:
    """Auth, connection limits, per-key fairness and shutdown (server/admission.py, connections.py)."""
    serve.add_argument("--api-key", default=None,
                       help="require `Authorization: Bearer <key>` on every route but /health and /metrics. Prefer "
                            "setting $SPECDEC_API_KEY: a flag shows in `ps` and in shell history. If both are set "
                            "they must be equal, else serve refuses to start")
    serve.add_argument("--docs-without-auth", action="store_true",
                       help="serve /docs, /redoc and /openapi.json without the key")
    serve.add_argument("--max-concurrent-requests-per-key", type=_at_least(1), default=None, metavar="N",
                       help="most completion requests in flight per bearer token (per client address for a client "
                            "that sends none), 429 beyond it; unset, no cap")
    serve.add_argument("--limit-concurrency", type=_at_least(2), default=None, metavar="N",
                       help="uvicorn's limit_concurrency: a request that arrives while N connections are open or "
                            "N requests are running gets 503 (its own connection counts); unset, no limit")
    serve.add_argument("--timeout-keep-alive", type=_at_least(1), default=5, metavar="SECONDS",
                       help="close an idle keep-alive connection after this long (uvicorn's timeout_keep_alive)")
    serve.add_argument("--timeout-header-read", type=_positive_float, default=10.0, metavar="SECONDS",
                       help="close a connection whose request head has not arrived this long after it connected "
                            "(or after its next request began): 408, or no answer if it sent nothing")
    serve.add_argument("--max-header-bytes", type=_at_least(1024), default=16384, metavar="BYTES",
                       help="largest request head (request line and headers); larger gets 431 (h11's "
                            "max_incomplete_event_size, also applied to a head that arrives whole)")
    serve.add_argument("--shutdown-timeout", type=_at_least(0.0, float), default=30.0, metavar="SECONDS",
                       help="on SIGTERM/SIGINT, how long requests in flight may go on while new ones get 503; then, "
                            "or at a second signal, they end with an error (streams: an error event and [DONE])")


def _string_list(text: str) -> list[str]:
    """A JSON list of strings (`'["https://a.example"]'`) or comma-separated values."""
    try:
        items = json.loads(text) if text.lstrip().startswith("[") else text.split(",")
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not a JSON list ({error}): {text}") from None
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text}")
    values = [item.strip() for item in items if item.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one value, got {text!r}")
    return values


def _add_ops_args(serve: argparse.ArgumentParser) -> None:
    """Logging, stream keep-alive and CORS (server/stats_log.py, request_log.py, streaming.py, cors.py)."""
    serve.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                       help="level of specdec's and uvicorn's loggers; debug also shows the traceback of a start-up "
                            "error")
    serve.add_argument("--stats-interval", type=_at_least(0.0, float), default=10.0, metavar="SECONDS",
                       help="log throughput, queue, KV cache, prefix cache and draft acceptance every SECONDS while "
                            "the engine is busy; 0 turns it off")
    serve.add_argument("--enable-log-requests", action="store_true",
                       help="log a line when each request is admitted (id, prompt tokens, sampling params, "
                            "speculation) and when it finishes (finish reason, tokens, TTFT, e2e); never text")
    serve.add_argument("--sse-keepalive", type=_at_least(0.0, float), default=10.0, metavar="SECONDS",
                       help="send an SSE comment `: keep-alive` on a stream that has been silent this long (queued, "
                            "or prefilling a long prompt), so proxies do not cut it; 0 turns it off")
    serve.add_argument("--allowed-origins", type=_string_list, default=None, metavar="LIST",
                       help="CORS: origins browsers may call from, a JSON list or comma-separated (e.g. '[\"*\"]'); "
                            "unset, no CORS headers are sent")
    serve.add_argument("--allowed-methods", type=_string_list, default=None, metavar="LIST",
                       help="CORS: allowed methods (needs --allowed-origins); unset, all")
    serve.add_argument("--allowed-headers", type=_string_list, default=None, metavar="LIST",
                       help="CORS: allowed request headers (needs --allowed-origins); unset, all")
    serve.add_argument("--allow-credentials", action="store_true",
                       help="CORS: allow credentials (cookies, Authorization); needs --allowed-origins without \"*\"")


def _add_limit_args(serve: argparse.ArgumentParser) -> None:
    """What one request may ask of the server (server/state.py ServerLimits; unset: its default)."""
    limit = _at_least(1)
    serve.add_argument("--max-body-bytes", type=limit, default=None, metavar="BYTES",
                       help="largest request body; larger gets 413 without being read (default 8 MiB)")
    serve.add_argument("--max-json-depth", type=limit, default=None, metavar="N",
                       help="deepest nesting of a request body's JSON; deeper gets 400 (default 64)")
    serve.add_argument("--max-prompts", type=limit, default=None, metavar="N",
                       help="most prompts in one completions request (default 64)")
    serve.add_argument("--max-choices", type=limit, default=None, metavar="N",
                       help="most choices (n × prompts) in one request (default 128)")
    serve.add_argument("--max-prompt-tokens", type=limit, default=None, metavar="N",
                       help="most prompt tokens in one request, all its prompts together (default 65536)")


_RAY_ONLY = ("ray_address", "num_cpus_per_replica", "min_replicas", "max_replicas", "target_ongoing_requests")


def _uses_ray(args: argparse.Namespace) -> bool:
    """Serve through Ray (server/ray_launch.py) when any Ray flag asks for it."""
    return bool(args.data_parallel_size > 1 or any(getattr(args, name) is not None for name in _RAY_ONLY))


def _add_ray_args(serve: argparse.ArgumentParser) -> None:
    """Engine replicas on Ray Serve behind this one endpoint (server/ray_app.py); any of these
    flags but --data-parallel-size 1 serves through Ray."""
    serve.add_argument("--data-parallel-size", type=_at_least(1), default=1, metavar="N",
                       help="engine replicas, each with its own engine and KV cache, behind one endpoint on Ray "
                            "Serve; requests go to the replica holding their prompt prefix unless it is busier")
    serve.add_argument("--ray-address", default=None, metavar="ADDRESS",
                       help="join this Ray cluster (e.g. HEAD_IP:6379, or auto) instead of starting a local one")
    serve.add_argument("--num-cpus-per-replica", type=_positive_float, default=None, metavar="CPUS",
                       help="CPUs Ray reserves for each replica, which runs that many torch threads (unset: 1)")
    serve.add_argument("--min-replicas", type=_at_least(1), default=None, metavar="N",
                       help="autoscale: fewest replicas (unset: 1)")
    serve.add_argument("--max-replicas", type=_at_least(1), default=None, metavar="N",
                       help="autoscale: most replicas (unset: --data-parallel-size, or --min-replicas if larger)")
    serve.add_argument("--target-ongoing-requests", type=_positive_float, default=None, metavar="N",
                       help="autoscale: requests in flight per replica that Serve scales to keep (unset: 2)")


def _add_tool_args(serve: argparse.ArgumentParser) -> None:
    """Tool calls in chat completions (server/tool_parsers.py; checked at start-up)."""
    serve.add_argument("--tool-call-parser", default=None, metavar="NAME",
                       help="how tool calls are read out of the model's text: hermes (<tool_call>{...}</tool_call>, "
                            "Qwen / Hermes / SmolLM2 style); needed for tool_choice \"auto\"")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="let the model decide whether to call tools (tool_choice \"auto\", the default when a "
                            "request has tools); needs --tool-call-parser")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec")
    parser.add_argument("--version", action="version", version=f"specdec {specdec_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server", formatter_class=HELP_FORMAT)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument("--served-model-name", default=None, help="the model name clients use; when not given, MODEL")
    _add_access_args(serve)
    _add_limit_args(serve)
    _add_ops_args(serve)
    _add_tool_args(serve)
    _add_ray_args(serve)
    add_engine_args(serve)
    serve.set_defaults(func=_serve)
    gen = sub.add_parser("generate", help="one-off generation", formatter_class=HELP_FORMAT)
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    gen.add_argument("--sampling-seed", type=int, default=None, help="seed of this request's sampling")
    add_engine_args(gen)
    gen.set_defaults(func=_generate)
    models = sub.add_parser("models", help="manage known models").add_subparsers(dest="action", required=True)
    pull_cmd = models.add_parser("pull", help="fetch and convert a known model")
    pull_cmd.add_argument("name", choices=sorted(KNOWN_MODELS))
    pull_cmd.add_argument("--force", action="store_true")
    pull_cmd.set_defaults(func=_pull)
    _add_eval(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
