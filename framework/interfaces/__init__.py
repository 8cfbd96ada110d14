"""One small abstract interface per extension point.

Every interface carries ``KVFORGE_HOOK_API``; see :mod:`kvforge.hookspecs`.
"""
from kvforge.interfaces.attention import (AttentionBackend, AttentionInputs, AttentionLayer,
                                          AttentionRequirements)
from kvforge.interfaces.drafter import Drafter, DrafterContext, DraftProposal
from kvforge.interfaces.kv_cache import KVAllocator
from kvforge.interfaces.model import ForwardMetadata, Model, ModelContext
from kvforge.interfaces.quantization import LinearMethod, QuantizationConfig
from kvforge.interfaces.scheduler import Scheduler, SchedulerContext, SchedulerOutput

__all__ = [
    "AttentionBackend", "AttentionInputs", "AttentionLayer", "AttentionRequirements", "Drafter",
    "DrafterContext", "DraftProposal", "KVAllocator", "ForwardMetadata", "Model", "ModelContext", "LinearMethod",
    "QuantizationConfig", "Scheduler", "SchedulerContext", "SchedulerOutput",
]
