"""The engine flags of `specdec serve` / `generate` are made from EngineConfig's fields."""
from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from specdec.cli import build_parser
from specdec.config import EngineConfig
from specdec.engine_args import engine_kwargs


def _help_entries(capsys: pytest.CaptureFixture[str], command: str) -> dict[str, str]:
    """`specdec <command> --help` as {first word of an entry: the entry on one line}."""
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args([command, "--help"])
    assert info.value.code == 0
    entries: dict[str, str] = {}
    name = ""
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("  ") and not line.startswith("   "):  # an entry starts; deeper lines go on with it
            name = line.split()[0]
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
            "--linear-backend", "fp32", "--attention-backend", "torch", "--seed", "7", "--device", "cpu"]
    args = build_parser().parse_args(argv)
    config = EngineConfig(model=args.model, **engine_kwargs(args))
    assert set(engine_kwargs(args)) | {"model"} == {f.name for f in fields(EngineConfig)}
    assert config.speculative_config is not None and config.speculative_config.num_speculative_tokens == 3
    expected = dict(model="my-model", max_model_len=100, max_num_batched_tokens=50, max_num_seqs=3, block_size=8,
                    kv_cache_memory=12345, kv_cache_dtype="fp8", enable_prefix_caching=True, dtype=torch.bfloat16,
                    linear_backend="fp32", attention_backend="torch", seed=7, device="cpu")
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
