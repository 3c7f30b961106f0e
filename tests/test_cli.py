"""The engine flags of `specdec serve` / `generate` are made from EngineConfig's fields; the
server's own flags, `specdec --version`, and start-up errors as one line and exit code 2."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from fastapi import FastAPI

from specdec.cli import build_parser, main
from specdec.config import EngineConfig
from specdec.engine_args import engine_kwargs
from specdec.server.app import uvicorn_config
from specdec.server.cors import CorsPolicy, cors_policy
from specdec.server.state import ServerOptions, server_options
from specdec.version import specdec_version


def _help_entries(capsys: pytest.CaptureFixture[str], command: str) -> dict[str, str]:
    """`specdec <command> --help` as {first word of an entry: the entry on one line}."""
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args([command, "--help"])
    assert info.value.code == 0
    entries: dict[str, str] = {}
    name = ""
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("  ") and not line.startswith("   "):  # an entry starts; deeper lines go on with it
            name = line.split()[0].rstrip(",")  # "--flag, --no-flag": a flag that defaults to on
            entries[name] = line.strip()
        elif name and line.startswith("   "):
            entries[name] += " " + line.strip()
        else:
            name = ""
    return entries


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_help_lists_every_option_with_its_help_and_default(command: str, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "10000")  # help text is not wrapped, so it reads back as written
    entries = _help_entries(capsys, command)
    for option in fields(EngineConfig):
        name = option.name if option.name == "model" else "--" + option.name.replace("_", "-")
        assert name in entries, f"{name} is missing from `specdec {command} --help`"
        assert f"{option.metadata['help']} (default: " in entries[name], entries[name]


def test_every_flag_reaches_the_config() -> None:
    argv = ["serve", "my-model", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
            "--max-model-len", "100", "--max-num-batched-tokens", "50", "--max-num-seqs", "3", "--block-size", "8",
            "--kv-cache-memory", "12345", "--kv-cache-dtype", "fp8", "--enable-prefix-caching", "--dtype", "bf16",
            "--linear-backend", "fp32", "--attention-backend", "torch", "--seed", "7", "--device", "cpu",
            "--max-grammar-compile-s", "2.5", "--max-guided-choices", "7", "--max-grammar-bytes", "4096"]
    args = build_parser().parse_args(argv)
    config = EngineConfig(model=args.model, **engine_kwargs(args))
    assert set(engine_kwargs(args)) | {"model"} == {f.name for f in fields(EngineConfig)}
    assert config.speculative_config is not None and config.speculative_config.num_speculative_tokens == 3
    expected = dict(model="my-model", max_model_len=100, max_num_batched_tokens=50, max_num_seqs=3, block_size=8,
                    kv_cache_memory=12345, kv_cache_dtype="fp8", enable_prefix_caching=True, dtype=torch.bfloat16,
                    linear_backend="fp32", attention_backend="torch", seed=7, device="cpu",
                    max_grammar_compile_s=2.5, max_guided_choices=7, max_grammar_bytes=4096)
    assert {name: getattr(config, name) for name in expected} == expected


def test_defaults_are_the_fields_defaults() -> None:
    args = build_parser().parse_args(["generate", "--prompt", "hi"])
    assert EngineConfig(model=args.model, **engine_kwargs(args)) == EngineConfig()


@pytest.mark.parametrize("value", ["none", "None", "null"])
def test_speculative_config_none_means_plain_decoding(value: str) -> None:
    args = build_parser().parse_args(["serve", "--speculative-config", value])
    assert EngineConfig(**engine_kwargs(args)).speculative_config is None


@pytest.mark.parametrize("flag, value", [("--device", "tpu"), ("--dtype", "float64"), ("--kv-cache-dtype", "int4"),
                                         ("--attention-backend", "flash"), ("--max-model-len", "big")])
def test_bad_values_are_refused_by_the_parser(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", flag, value])
    assert flag in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"specdec {specdec_version()}\n"


def test_serve_flags_reach_uvicorn_and_the_app() -> None:
    args = build_parser().parse_args(["serve", "tiny", "--log-level", "warning", "--stats-interval", "0",
                                      "--sse-keepalive", "2.5", "--enable-log-requests", "--allowed-origins",
                                      '["https://a.example", "https://b.example"]', "--allowed-headers", "x-a, x-b"])
    assert uvicorn_config(FastAPI(), args).log_level == "warning"
    assert server_options(args) == ServerOptions(stats_interval=0.0, sse_keepalive=2.5, log_requests=True)
    assert cors_policy(args) == CorsPolicy(["https://a.example", "https://b.example"], ["*"], ["x-a", "x-b"])
    defaults = build_parser().parse_args(["serve", "tiny"])
    assert server_options(defaults) == ServerOptions() and cors_policy(defaults) is None
    assert uvicorn_config(FastAPI(), defaults).log_level == "info"


@pytest.mark.parametrize("flags", [["--allowed-origins", "[1]"], ["--allowed-origins", "[oops"],
                                   ["--allowed-origins", ","], ["--stats-interval", "-1"], ["--sse-keepalive", "nan"],
                                   ["--log-level", "verbose"]])
def test_bad_ops_flags_are_refused_by_the_parser(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *flags])
    assert flags[0] in capsys.readouterr().err


@pytest.mark.parametrize("flags, needle", [
    (["--allowed-origins", "*", "--allow-credentials"], '--allow-credentials cannot be used with the origin "*"'),
    (["--allowed-methods", "GET"], "--allowed-methods needs --allowed-origins"),
])
def test_refused_flag_combinations_exit_2_with_one_line(flags: list[str], needle: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "no-such-model", *flags])  # refused before the model would load
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specdec serve: error: ") and needle in err, err


def test_startup_error_exits_2_with_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "no-model-here"
    done = subprocess.run([sys.executable, "-m", "specdec.cli", "serve", str(missing), "--port", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("specdec serve: error: model "), done.stderr
    assert str(missing) in done.stderr and "Traceback" not in done.stderr
