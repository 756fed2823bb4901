"""pd-runtime: a prefill/decode disaggregated LLM serving runtime on Ray.

The offline entry points live here; the serving runtime is started by `pd-runtime serve`.
"""

from pd_runtime.api import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]


def __getattr__(name):
    # LLM pulls in torch; keep `import pd_runtime` cheap for torch-free users (the router).
    if name in ("LLM", "RequestOutput", "CompletionOutput", "Logprob"):
        from pd_runtime.engine import llm

        return getattr(llm, name)
    raise AttributeError(name)
