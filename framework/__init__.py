"""kvforge: a plugin-based LLM inference engine.

Public API: :class:`LLM`, :class:`SamplingParams`, :class:`EngineConfig`,
:data:`hookimpl` (the marker plugin authors decorate their hooks with).
"""
from kvforge.config import EngineConfig
from kvforge.engine.outputs import CompletionOutput, Logprob, RequestOutput
from kvforge.engine.sampling_params import RequestOutputKind, SamplingParams
from kvforge.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams
from kvforge.hookspecs import KVFORGE_HOOK_API, hookimpl

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in transformers and the engine; import lazily so `import kvforge`
    # stays cheap for plugin authors who only need hookimpl.
    if name == "LLM":
        from kvforge.entrypoints.llm import LLM
        return LLM
    if name == "LLMEngine":
        from kvforge.engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)


__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutputKind", "BeamSearchParams", "BeamSearchOutput",
           "EngineConfig", "RequestOutput", "CompletionOutput", "Logprob", "hookimpl", "KVFORGE_HOOK_API"]
