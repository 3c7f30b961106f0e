"""GrammarCompiler: constraints are compiled on its worker threads (never the engine's), once
per distinct constraint (cached by source), refused over the size limits before any work
and over the time limit while compiling, with errors that name the bound."""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from specdec import SamplingParams
from specdec.async_engine import AsyncEngine
from specdec.llm import LLM
from specdec.sampling_params import StructuredOutputsParams as Constraint
from specdec.structured_output import CompiledGrammar, GrammarCompiler, GrammarError, GrammarLimits


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Any) -> LLM:
    return LLM(str(tiny_model_dir), max_model_len=128, speculative_config=None)


def compiler(llm: LLM, **limits: Any) -> GrammarCompiler:
    engine = llm.engine
    return GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids,
                           GrammarLimits(**limits))


def test_a_constraint_is_compiled_once(llm: LLM) -> None:
    grammars = compiler(llm)
    first = grammars.compile(Constraint(choice=["yes", "no"]))
    assert grammars.compile(Constraint(choice=["yes", "no"])) is first
    assert grammars.compile(Constraint(json={"b": 1, "a": {"type": "string"}} | {"type": "object"})) is \
        grammars.compile(Constraint(json={"type": "object", "a": {"type": "string"}, "b": 1}))
    assert grammars.compile(Constraint(choice=["yes", "no", "maybe"])) is not first


def test_each_request_gets_its_own_state(llm: LLM) -> None:
    grammars = compiler(llm)
    constraint = Constraint(regex="ab+")
    compiled = grammars.compile(constraint)
    one, two = grammars.grammar(constraint, compiled), grammars.grammar(constraint)
    tokenizer = llm.get_tokenizer()
    one.advance(tokenizer.encode("ab", add_special_tokens=False))
    assert one.num_consumed > 0 and two.num_consumed == 0
    with pytest.raises(ValueError, match="not the request's constraint"):
        grammars.grammar(Constraint(regex="c"), compiled)


@pytest.mark.parametrize(("constraint", "limits", "needle"), [
    (Constraint(choice=["a", "b", "c"]), {"max_choices": 2}, "3 items, more than max_guided_choices=2"),
    (Constraint(regex="x" * 101), {"max_bytes": 100}, "regex is 101 bytes, more than max_grammar_bytes=100"),
])
def test_size_limits_refuse_before_any_work(llm: LLM, constraint: Constraint, limits: dict[str, int],
                                            needle: str) -> None:
    grammars = compiler(llm, **limits)
    with pytest.raises(GrammarError, match=needle):
        grammars.compile(constraint)
    assert not grammars._compiled  # nothing was submitted


def test_a_slow_compile_is_refused_naming_the_bound(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    grammars = compiler(llm, compile_s=0.05)
    build = grammars._build

    def slow_build(params: Constraint) -> CompiledGrammar:
        time.sleep(0.5)
        return build(params)

    monkeypatch.setattr(grammars, "_build", slow_build)
    with pytest.raises(GrammarError, match="took longer than max_grammar_compile_s=0.05 s"):
        grammars.compile(Constraint(regex="slow"))
    with pytest.raises(GrammarError, match="max_grammar_compile_s"):
        asyncio.run(grammars.compile_async(Constraint(regex="slower")))


def test_the_server_path_compiles_off_the_engine_thread(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    grammars = llm.engine.grammars
    build = grammars._build
    threads: list[str] = []

    def recording(params: Constraint) -> CompiledGrammar:
        threads.append(threading.current_thread().name)
        return build(params)

    monkeypatch.setattr(grammars, "_build", recording)

    async def run() -> None:
        engine = AsyncEngine(llm.engine)
        params = SamplingParams(max_tokens=3, structured_outputs=Constraint(regex="[a-c]+ok"))
        outputs = [output async for output in await engine.generate("g", [1, 2, 3], params)]
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason in ("stop", "length")
        with pytest.raises(ValueError, match="invalid regex"):
            await engine.generate("h", [1, 2, 3], SamplingParams(structured_outputs=Constraint(regex="(")))
        await engine.shutdown(drain=False)

    asyncio.run(run())
    assert threads and all(name.startswith("specdec-grammar") for name in threads)


@pytest.mark.parametrize(("message", "told"), [
    ("panic: assertion failed: grammar.symbols.len() < u16::MAX\n<backtrace>\n   0: <unknown>",
     "the grammar is too large or complex to compile"),
    ("Parser Error: Too many items\n<state>\nTokens: SECRET\n</state><grammar>SECRET</grammar>",
     "Parser Error: Too many items"),
    ("x" * 400, "x" * 300 + "…"),
])
def test_library_messages_reach_clients_without_dumps(message: str, told: str) -> None:
    from specdec.structured_output import _brief

    assert _brief(message) == told
