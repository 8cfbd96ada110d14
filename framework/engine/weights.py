"""Checkpoint loading: safetensors (single file or sharded with an index) or dummy weights."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's ``*.safetensors`` files, from ``model.safetensors.index.json`` if present.

    Raises:
        ValueError: no safetensors file in ``model_dir``.
    """
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [d / s for s in shards]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {d} (use load_format='dummy' for random weights)")
    return files


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the checkpoint, one shard at a time (CPU).

    Raises:
        ValueError: naming the file, for a shard that is truncated or not safetensors.
    """
    for f in safetensors_files(model_dir):
        try:
            sf = safe_open(str(f), framework="pt", device="cpu")
        except Exception as e:  # safetensors' own error type: a truncated or corrupt file
            raise ValueError(f"checkpoint file {str(f)!r} is not a readable safetensors file: {e}") from None
        with sf:
            for name in sf.keys():
                try:
                    tensor = sf.get_tensor(name)
                except Exception as e:  # noqa: BLE001 - header fine, data cut short
                    raise ValueError(f"checkpoint file {str(f)!r}: tensor {name!r} cannot be read: {e}") from None
                yield name, tensor


def load_weights(model: torch.nn.Module, model_dir: str, load_format: str, seed: int) -> None:
    """Fill ``model``'s parameters.

    ``load_format``: ``auto``/``safetensors`` reads the checkpoint and checks that
    every parameter was filled; ``dummy`` draws uniform(-1e-3, 1e-3) values with
    the real shapes (for benchmarks), as vLLM does.

    Raises:
        ValueError: a checkpoint tensor is unknown, mis-shaped, or a parameter is missing.
    """
    if load_format == "dummy":
        gens: dict[torch.device, torch.Generator] = {}
        for p in model.parameters():
            if p.is_floating_point():  # drawn on the parameter's device: 8B params in seconds on a GPU
                g = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
                if torch.finfo(p.dtype).bits < 16:  # FP8: torch draws no uniform values in it; draw, then cast
                    p.data.copy_(torch.empty(p.shape, device=p.device).uniform_(-1e-3, 1e-3, generator=g))
                else:
                    p.data.uniform_(-1e-3, 1e-3, generator=g)
        for m in model.modules():
            if hasattr(m, "method"):
                m.method.process_weights_after_loading(m)
        return
    loaded = model.load_weights(iter_safetensors(model_dir))
    expected = getattr(model, "expected_weights", None)
    if expected is not None:
        missing = sorted(expected() - loaded)
        if missing:
            raise ValueError(f"checkpoint {model_dir} is missing tensors for: {', '.join(missing[:8])}"
                             + (" ..." if len(missing) > 8 else ""))
    for m in model.modules():
        if hasattr(m, "method"):
            m.method.process_weights_after_loading(m)
