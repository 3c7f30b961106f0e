"""specdec: a speculative-decoding-first LLM inference engine."""
from specdec.outputs import CompletionOutput, Logprob, RequestOutput
from specdec.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
           "Logprob"]


def __getattr__(name: str) -> object:
    # LLM and AsyncLLM pull in torch and transformers: import them only when asked for.
    if name == "LLM":
        from specdec.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from specdec.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(name)
