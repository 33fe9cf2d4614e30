"""kvtune runtime: a Llama-family model served over a paged, quantized, compressed KV cache."""

from kvtune.runtime.policy import KVPolicy


def __getattr__(name: str):
    # LLM pulls in Triton, the kernels and the model: import it on first use only, so that
    # `from kvtune.runtime.policy import KVPolicy` (the planner, the CLI) stays quick.
    if name == "LLM":
        from kvtune.runtime.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "KVPolicy"]
