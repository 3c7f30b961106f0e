"""Engine options as command-line flags: one flag per EngineConfig field, and back."""
from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, get_type_hints

import torch

from specdec.config import KV_CACHE_DTYPES, EngineConfig, engine_options

# kept for callers that name the --kv-cache-dtype choices
KV_CACHE_DTYPE_NAMES = tuple(KV_CACHE_DTYPES)
# argparse types of the option types; other options arrive as text (a dtype name, JSON)
# and EngineConfig converts them
_ARG_TYPES: dict[Any, Callable[[str], Any]] = {int: int, float: float}
HELP_FORMAT = argparse.ArgumentDefaultsHelpFormatter  # every flag's help ends with its default


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (`model` is the positional argument), with its help,
    default and choices taken from the field."""
    hints = get_type_hints(EngineConfig)
    for option in engine_options():
        help_text, default = option.metadata["help"], _typed_as(option.default)
        if option.name == "model":
            parser.add_argument("model", nargs="?", default=default, help=help_text)
        elif hints[option.name] in (bool, bool | None):  # bool | None: --flag, --no-flag or neither (auto)
            action = "store_true" if default is False else argparse.BooleanOptionalAction
            parser.add_argument(_flag(option.name), action=action, default=default, help=help_text)
        else:
            parser.add_argument(_flag(option.name), type=_ARG_TYPES.get(hints[option.name], str), default=default,
                                choices=option.metadata["choices"], help=help_text)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed engine options, as `LLM(**engine_kwargs(args))` takes them (without model)."""
    return {option.name: getattr(args, option.name) for option in engine_options() if option.name != "model"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _typed_as(default: Any) -> Any:
    """A default as one would type it (a dtype by name), so --help shows it that way."""
    if isinstance(default, torch.dtype):
        return str(default).removeprefix("torch.")
    return default
