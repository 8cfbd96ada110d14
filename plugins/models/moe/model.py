"""Checkpoint loading shared by the MoE model plugins (per-expert HF tensors -> :class:`FusedMoE`)."""
from __future__ import annotations

import re
from typing import Iterable

import torch

from kvforge_plugins.models.moe.layer import FusedMoE

#: HF per-expert projection name -> FusedMoE kind (Mixtral ``w1/w3/w2``, Qwen2-MoE ``*_proj``).
EXPERT_KINDS = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")
_FUSED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")  # transformers >= 5 in-memory layout


class MoEWeightsMixin:
    """Mixed into a Llama-layout causal LM whose sparse blocks hold a ``FusedMoE`` named
    ``<layer>.mlp.experts``. Expert tensors are routed to it (only this rank's experts;
    the rest of the checkpoint goes through the Llama loader). ``rename`` maps checkpoint
    names onto module names (Mixtral's ``block_sparse_moe`` -> ``mlp``)."""

    RENAMES: tuple[tuple[str, str], ...] = ()

    def rename(self, name: str) -> str:
        for old, new in self.RENAMES:
            name = name.replace(old, new)
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()

        def rest():
            for name, tensor in weights:
                name = self.rename(name)
                m = _PER_EXPERT.match(name)
                f = None if m else _FUSED.match(name)
                if m is None and f is None:
                    yield name, tensor
                    continue
                if not self._is_local(name):  # another pipeline stage's layer
                    continue
                path = (m or f).group(1)
                try:
                    moe = self.get_submodule(path)
                except AttributeError:
                    moe = None
                if not isinstance(moe, FusedMoE):
                    raise ValueError(f"checkpoint tensor {name!r} does not belong to {type(self).__name__}")
                if m is not None:
                    if m.group(3) not in EXPERT_KINDS:
                        raise ValueError(f"checkpoint tensor {name!r}: unknown expert projection {m.group(3)!r}")
                    tags = [moe.load_expert(EXPERT_KINDS[m.group(3)], int(m.group(2)), tensor)]
                elif f.group(2) == "down_proj":  # [E, H, I]
                    tags = [moe.load_expert("down", e, tensor[e]) for e in range(tensor.shape[0])]
                else:  # gate_up_proj [E, 2I, H]
                    i = tensor.shape[1] // 2
                    tags = [moe.load_expert(kind, e, tensor[e, lo:lo + i]) for e in range(tensor.shape[0])
                            for kind, lo in (("gate", 0), ("up", i))]
                loaded.update(t for t in tags if t is not None)

        loaded |= super().load_weights(rest())
        return loaded

    def expected_weights(self) -> set[str]:
        names = super().expected_weights()
        for mname, module in self.named_modules():
            if isinstance(module, FusedMoE):
                names -= {f"{mname}.w13_weight", f"{mname}.w2_weight"}
                names |= module.expected_names()
        return names
