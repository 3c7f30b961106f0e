"""specdec: a speculative-decoding-first LLM inference engine."""
from specdec.outputs import CompletionOutput, RequestOutput
from specdec.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str) -> object:
    # LLM pulls in torch and transformers: import it only when asked for.
    if name == "LLM":
        from specdec.llm import LLM

        return LLM
    raise AttributeError(name)
