"""`specdec serve | generate | models pull | eval` — the command line, vLLM style."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from specdec.engine_args import HELP_FORMAT, add_engine_args, engine_kwargs
from specdec.model_registry import KNOWN_MODELS, pull


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server", formatter_class=HELP_FORMAT)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument("--api-key", default=None,
                       help="require `Authorization: Bearer <key>`; when not given, $SPECDEC_API_KEY if set")
    serve.add_argument("--served-model-name", default=None, help="the model name clients use; when not given, MODEL")
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
