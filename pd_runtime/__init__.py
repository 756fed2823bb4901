"""pd-runtime: a prefill/decode disaggregated LLM serving runtime on Ray.

The offline entry points live here; the serving runtime is started by `pd-runtime serve`.
"""

from pd_runtime.api import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name):
    # LLM pulls in torch; keep `import pd_runtime` cheap for torch-free users (the router).
    if name == "LLM":
        from pd_runtime.engine.llm import LLM

        return LLM
    raise AttributeError(name)
