"""Structural rules of the code base: no import cycles (deferred imports included), the
layers (kernels import only kernels, models only models and kernels, the engine core no
server module and no concrete drafter), no Python file over 500 lines, and one draft form
(no chain-vs-tree branches)."""
from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Source folder -> the package it installs as (pyproject.toml's package-dir).
PACKAGES = {"specdec": "specdec", "kernels": "specdec.kernels", "drafters": "specdec.drafters",
            "server": "specdec.server", "evals": "specdec.evals"}
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    modules = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts))
            modules[name.removesuffix(".__init__")] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(tree: ast.AST) -> list[str]:
    """Every module imported when the code runs, at module level or inside functions
    (deferred), leaving out `if TYPE_CHECKING:` blocks."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for branch in node.orelse:
                visit(branch)
            return
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
            found.extend(f"{node.module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(ancestors: bool = False) -> dict[str, set[str]]:
    """Each module's runtime imports of our own modules. A package's __init__ runs on first
    import of any submodule, so an import of a module's own enclosing package is no edge
    for the cycle check; `ancestors` keeps those edges, for the layer rules (`from specdec
    import LLM` in kernels/ depends on specdec/__init__.py)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = {t for t in _runtime_imports(ast.parse(path.read_text())) if t in modules}
        graph[name] = {t for t in targets if t != name and (ancestors or not name.startswith(t + "."))}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


# ---- layers ------------------------------------------------------------------------------

KERNELS, MODELS, DRAFTERS, SERVER = "specdec.kernels", "specdec.models", "specdec.drafters", "specdec.server"
NOT_CORE = (KERNELS, MODELS, DRAFTERS, SERVER, "specdec.evals")
# What the core may use of drafters/: the interface (base.py, which the package re-exports)
# and the factory that builds a drafter by name.
DRAFTER_INTERFACE = {DRAFTERS, f"{DRAFTERS}.base", f"{DRAFTERS}.factory"}
# The command line sits above every layer: `specdec serve` starts the server (server/app.py,
# server/ray_launch.py), `specdec eval` runs evals/.
ENTRY_POINTS = {"specdec.cli"}


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def is_core(name: str) -> bool:
    """The engine core: the modules directly under specdec/ and specdec/spec/."""
    parts = name.split(".")
    if parts[0] != "specdec" or any(_within(name, p) for p in NOT_CORE):
        return False
    return len(parts) <= 2 or _within(name, "specdec.spec")


def _core_may_import(target: str) -> bool:
    return not _within(target, SERVER) and (not _within(target, DRAFTERS) or target in DRAFTER_INTERFACE)


KERNELS_RULE = "kernels/ imports nothing of specdec but specdec.kernels"
MODELS_RULE = "specdec/models/ imports only specdec.models and specdec.kernels"
CORE_RULE = "the core (specdec/*.py, specdec/spec/) imports no server module and no concrete drafter"
# rule -> (whether it binds an importing module, whether that module may import a target)
LAYER_RULES: dict[str, tuple[Callable[[str], bool], Callable[[str], bool]]] = {
    KERNELS_RULE: (lambda m: _within(m, KERNELS), lambda t: _within(t, KERNELS)),
    MODELS_RULE: (lambda m: _within(m, MODELS), lambda t: _within(t, MODELS) or _within(t, KERNELS)),
    CORE_RULE: (lambda m: is_core(m) and m not in ENTRY_POINTS, _core_may_import),
}


def layer_violations(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Per rule, every import that breaks it, as "importer -> imported"."""
    return {rule: sorted(f"{m} -> {t}" for m, targets in graph.items() if binds(m)
                         for t in targets if not may_import(t))
            for rule, (binds, may_import) in LAYER_RULES.items()}


def test_imports_found_include_deferred_ones_but_not_type_checking_ones() -> None:
    source = """
from typing import TYPE_CHECKING
import specdec.a
if TYPE_CHECKING:
    from specdec.server import b
else:
    import specdec.c
def f():
    from specdec.drafters.ngram import NgramDrafter
"""
    found = _runtime_imports(ast.parse(source))
    assert {"specdec.a", "specdec.c", "specdec.drafters.ngram"} <= set(found)
    assert not any(name.startswith("specdec.server") for name in found)


def test_the_core_is_specdec_and_spec_only() -> None:
    assert all(map(is_core, ["specdec", "specdec.engine", "specdec.spec", "specdec.spec.verify"]))
    assert not any(map(is_core, ["specdec.models", "specdec.models.llama", "specdec.kernels.linear",
                                 "specdec.drafters.base", "specdec.server.app", "specdec.evals.latency"]))


def test_the_layer_rules_catch_what_breaks_them() -> None:
    fake = {
        "specdec.kernels.linear": {"specdec.kernels.gguf_blocks", "specdec.model_registry"},
        "specdec.kernels.cpu_build": {"specdec", "specdec.kernels"},
        "specdec.models.loader": {"specdec.kernels.linear", "specdec.models.config", "specdec.gguf_convert"},
        "specdec.models.tokenizer": {"specdec.drafters.base"},
        "specdec.gpu_memory": {"specdec.models", "specdec.drafters.factory", "specdec.drafters.draft_model"},
        "specdec.spec.verify": {"specdec.drafters.base", "specdec.drafters", "specdec.server.async_engine"},
        "specdec.async_llm": {"specdec.server", "specdec.engine"},
        "specdec.cli": {"specdec.server.app"},  # the entry point
        "specdec.server.app": {"specdec.drafters.ngram", "specdec.engine"},  # not bound by these rules
        "specdec.drafters.ngram": {"specdec.server.errors", "specdec.model_registry"},
    }
    assert layer_violations(fake) == {
        KERNELS_RULE: ["specdec.kernels.cpu_build -> specdec", "specdec.kernels.linear -> specdec.model_registry"],
        MODELS_RULE: ["specdec.models.loader -> specdec.gguf_convert",
                      "specdec.models.tokenizer -> specdec.drafters.base"],
        CORE_RULE: ["specdec.async_llm -> specdec.server", "specdec.gpu_memory -> specdec.drafters.draft_model",
                    "specdec.spec.verify -> specdec.server.async_engine"],
    }


@pytest.mark.parametrize("rule", list(LAYER_RULES))
def test_layers(rule: str) -> None:
    """Runtime imports, deferred ones included; imports under `if TYPE_CHECKING:` are free."""
    graph = import_graph(ancestors=True)
    binds, _ = LAYER_RULES[rule]
    assert any(map(binds, graph)), f"{rule}: binds no module (were the folders renamed?)"
    assert layer_violations(graph)[rule] == []


def test_no_python_file_over_the_limit() -> None:
    long = {str(p.relative_to(ROOT)): n for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_one_draft_form() -> None:
    """Every draft is a DraftTree: nothing branches on a missing tree or a tree mode."""
    offenders = [str(p.relative_to(ROOT)) for p in _modules().values()
                 if "tree is None" in p.read_text() or "tree_mode" in p.read_text()]
    assert offenders == []
