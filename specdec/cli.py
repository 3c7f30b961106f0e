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

from specdec.model_registry import DEFAULT_MODEL, KNOWN_MODELS, pull

# The keys of specdec.config.KV_CACHE_DTYPES (a test checks), spelled out to keep torch
# out of the argument parser.
KV_CACHE_DTYPE_NAMES = ("auto", "fp32", "fp16", "bf16", "fp8")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--speculative-config", type=json.loads, default=None,
                        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\'')
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_NAMES,
                        help="KV cache storage dtype (auto: the model dtype); fp16/bf16 halve KV memory, "
                             "fp8 (e4m3 with per-token, per-head scales) about quarters it")
    parser.add_argument("--enable-prefix-caching", action="store_true")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--linear-backend", default="auto",
                        help="packed CPU matmuls for the projections and LM head: auto | cpp-fp16 | fp16 | fp32 "
                             "| int8 | int8-rowwise | bf16 | onednn-fp32 | onednn-bf16 (see evals/bench_kernels.py)")
    parser.add_argument("--attention-backend", default="auto", choices=("auto", "cpp", "torch"),
                        help="CPU attention: the C++ paged kernel (cpp; auto uses it when it builds) or "
                             "the torch reference (torch); CUDA always runs Triton")
    parser.add_argument("--seed", type=int, default=0)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        speculative_config=args.speculative_config, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=args.enable_prefix_caching,
        dtype=args.dtype, seed=args.seed, linear_backend=args.linear_backend,
        attention_backend=args.attention_backend,
    )


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
    if args.speculative_config:
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
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--served-model-name", default=None)
    add_engine_args(serve)
    serve.set_defaults(func=_serve)
    gen = sub.add_parser("generate", help="one-off generation")
    gen.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
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
