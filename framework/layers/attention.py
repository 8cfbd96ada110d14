"""Attention layer: holds the per-layer facts and calls the chosen backend."""
from __future__ import annotations

from dataclasses import replace

import torch

from kvforge.interfaces import AttentionBackend, AttentionLayer, ForwardMetadata
from kvforge.layers.kv_cache_dtype import FP8_MAX, is_fp8

#: checkpoint tensor name endings that carry an FP8 KV cache scale -> which scales they set
#: (llm-compressor / vLLM ``self_attn.k_scale``; NVIDIA ModelOpt's ``k_proj.k_scale``; older
#: exports' ``k_proj.output_scale``; the deprecated single ``kv_scale`` for both). Longer
#: endings first: ``kv_scale_target`` takes the first that matches.
KV_SCALE_NAMES = {
    "k_proj.output_scale": (0,), "v_proj.output_scale": (1,), "k_proj.k_scale": (0,), "v_proj.v_scale": (1,),
    "k_scale": (0,), "v_scale": (1,), "kv_scale": (0, 1),
}


def kv_scale_target(name: str) -> tuple[str, str] | None:
    """For a checkpoint tensor carrying an FP8 KV cache scale (``model.layers.3.self_attn.k_scale``),
    the path of the attention module it belongs to and its :data:`KV_SCALE_NAMES` key
    (``("model.layers.3.self_attn", "k_scale")``); None for any other tensor."""
    for suffix in KV_SCALE_NAMES:
        if name.endswith("." + suffix):
            return name[: -len(suffix) - 1], suffix
    return None


def arm_kv_scale_calibration(model: torch.nn.Module) -> int:
    """Have every PagedAttention of ``model`` set its FP8 K/V scales from its next forward's K
    and V (``cache.calculate_kv_scales``); returns how many layers were armed. The caller must
    run that forward eagerly (a CUDA-graph replay would skip the Python that calibrates)."""
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    for m in layers:
        m.calibrate_kv_scales = True
    return len(layers)


class PagedAttention(torch.nn.Module):
    """q [T, Hq*D], k/v [T, Hkv*D] -> [T, Hq*D] via ``backend.forward`` over this layer's paged cache.

    Holds ``kv_scale`` (float32 [2] buffer: the K and V scales of an FP8 KV cache, 1.0 until
    a checkpoint sets them) and hands it to the backend in ``layer.kv_scale``. With
    ``calibrate_kv_scales`` set (``cache.calculate_kv_scales``), the next forward over an FP8
    cache first sets each scale to ``amax * CALIBRATION_HEADROOM / FP8_MAX`` of that step's K or
    V (on the device, no host sync), then clears the flag.
    """

    #: the calibrating step's largest |K| / |V| is stored at FP8_MAX / this: later tokens may be
    #: this many times larger before they saturate (vLLM divides by 200 / 100 in E4M3: ~2.2x / 4.5x)
    CALIBRATION_HEADROOM = 2.0

    def __init__(self, backend: AttentionBackend, layer: AttentionLayer) -> None:
        super().__init__()
        self.backend = backend
        self.register_buffer("kv_scale", torch.ones(2, dtype=torch.float32), persistent=False)
        self.layer = replace(layer, kv_scale=self.kv_scale)
        self.calibrate_kv_scales = False

    def _apply(self, fn, recurse=True):
        # .to() / .half() replace buffers: keep the scales float32 and the layer's view current.
        super()._apply(fn, recurse)
        self._buffers["kv_scale"] = self._buffers["kv_scale"].float()
        self.layer = replace(self.layer, kv_scale=self.kv_scale)
        return self

    def load_kv_scale(self, suffix: str, tensor: torch.Tensor) -> None:
        """Set the K and/or V scale from a checkpoint tensor ending in ``suffix`` (a key of
        :data:`KV_SCALE_NAMES`).

        Raises:
            ValueError: the tensor is not one value, or not finite and > 0.
        """
        if tensor.numel() != 1:
            raise ValueError(f"a KV cache scale must hold one value, got shape {tuple(tensor.shape)}")
        value = float(tensor.float().reshape(()))
        if not value > 0 or value == float("inf"):
            raise ValueError(f"a KV cache scale must be finite and > 0, got {value}")
        for i in KV_SCALE_NAMES[suffix]:
            self.kv_scale[i] = value

    def _calibrate(self, k: torch.Tensor, v: torch.Tensor, cache_dtype: torch.dtype) -> None:
        per = self.CALIBRATION_HEADROOM / FP8_MAX[cache_dtype]
        amax = torch.stack([k.detach().abs().amax(), v.detach().abs().amax()]).float()
        self.kv_scale.copy_(torch.where(amax > 0, amax * per, torch.ones_like(amax)))  # all-zero K: keep 1.0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: ForwardMetadata) -> torch.Tensor:
        L = self.layer
        t = q.shape[0]
        if self.calibrate_kv_scales:
            cache_dtype = meta.kv_caches[L.layer_idx].dtype
            if is_fp8(cache_dtype) and t:
                self._calibrate(k, v, cache_dtype)
            self.calibrate_kv_scales = False
        out = self.backend.forward(L, q.view(t, L.num_heads, L.head_size), k.view(t, L.num_kv_heads, L.head_size),
                                   v.view(t, L.num_kv_heads, L.head_size), meta.kv_caches[L.layer_idx],
                                   meta.attn_metadata)
        return out.reshape(t, L.num_heads * L.head_size)
