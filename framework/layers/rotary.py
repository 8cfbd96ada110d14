"""Rotary position embedding (RoPE, Su et al. 2021), "rotate half" layout as in HF Llama.

Frequencies for scaled variants (linear, dynamic, yarn, longrope, llama3) come
from transformers' ``ROPE_INIT_FUNCTIONS`` so kvforge matches the reference
implementation exactly; the default is ``theta ** (-2i/d)``.
"""
from __future__ import annotations

import torch

from kvforge.layers import triton_ops


def _rope_params(hf_config) -> dict:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    params = dict(params)
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def inv_freq_for(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Return (inv_freq float32 [rotary_dim/2], attention_scaling) for ``hf_config``.

    Raises:
        ValueError: for a rope_type transformers does not know.
    """
    params = _rope_params(hf_config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        rotary_dim = int(head_dim * getattr(hf_config, "partial_rotary_factor", 1.0))
        exps = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        return 1.0 / (params["rope_theta"] ** exps), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_scaling.rope_type {rope_type!r} is not supported; known: "
                         f"default, {', '.join(ROPE_INIT_FUNCTIONS)}")
    if rope_type == "dynamic":
        raise ValueError("rope_scaling.rope_type 'dynamic' depends on the sequence length and is not supported")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(torch.nn.Module):
    """Applies RoPE to q [T, Hq, D] and k [T, Hkv, D] at int64 ``positions`` [T].

    cos/sin are precomputed for ``max_position`` positions in float32 and the
    rotation is done in float32, then cast back (as HF does).
    """

    def __init__(self, hf_config, head_dim: int, max_position: int) -> None:
        super().__init__()
        inv_freq, scaling = inv_freq_for(hf_config, head_dim)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.rotary_dim = inv_freq.numel() * 2
        self.register_buffer("cos", freqs.cos() * scaling, persistent=False)
        self.register_buffer("sin", freqs.sin() * scaling, persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rd = self.rotary_dim
        xr = x[..., :rd].float()
        x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
        c = torch.cat([cos, cos], -1).unsqueeze(1)
        s = torch.cat([sin, sin], -1).unsqueeze(1)
        out = xr * c + torch.cat([-x2, x1], -1) * s
        if rd == x.shape[-1]:
            return out.to(x.dtype)
        return torch.cat([out.to(x.dtype), x[..., rd:]], -1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, Hq, D], k [T, Hkv, D] -> rotated (q, k); on CUDA rotated in place.

        ``positions`` must lie in ``[0, max_position)``; this is not checked here (a check
        would cost a device sync per layer and break CUDA-graph capture). The engine keeps
        it by refusing any request longer than max_model_len, which start-up keeps
        <= max_position_embeddings.
        """
        if triton_ops.enabled(q) and q.stride(-1) == 1 and k.stride(-1) == 1:
            triton_ops.rope_qk_inplace(q, k, positions, self.cos, self.sin)
            return q, k
        cos, sin = self.cos[positions], self.sin[positions]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
