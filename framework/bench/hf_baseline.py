"""Hugging Face transformers baseline for ``kvforge bench throughput --baseline hf``.

The baseline is what people run without a serving engine: ``AutoModelForCausalLM.generate`` over
static batches of the SAME prompts, in the benchmark's order, ``--hf-batch-size`` at a time, padded on
the left with an attention mask. A static batch runs until its longest request is done, so every row
generates ``max(output_len in the batch)`` tokens (``min_new_tokens = max_new_tokens``, so EOS cannot
end it early); only each prompt's own ``output_len`` tokens count as useful output. That is the figure
compared with kvforge (whose requests each stop at their own ``output_len``).

Weights: with ``load_format="dummy"`` the model is built from the same ``config.json`` with HF's
random initialisation (the point is speed, not text), else loaded from the checkpoint; in both cases in
kvforge's resolved dtype, on kvforge's device, with HF's default attention implementation.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

from kvforge.bench.datasets import BenchRequest


def load_hf_model(model_dir: str, load_format: str, dtype: Any, device: Any, seed: int = 0,
                  progress: bool = True) -> Any:
    """``AutoModelForCausalLM`` for ``model_dir`` in ``dtype`` on ``device``, in eval mode;
    ``progress`` False hides transformers' weight-loading bar (``--disable-tqdm``).

    Raises:
        ValueError: the directory has no config transformers can read, or no weights when
            ``load_format`` is not ``dummy``.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    was_enabled = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        if load_format == "dummy":
            cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
            torch.manual_seed(seed)
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True).to(device)
    except (OSError, ValueError) as e:
        raise ValueError(f"--baseline hf: transformers cannot load {model_dir!r}: {e}") from None
    finally:
        if was_enabled and not progress:
            hf_logging.enable_progress_bar()
    return model.eval()


def run_hf_generate(model: Any, requests: Sequence[BenchRequest], batch_size: int, temperature: float,
                    device: Any, use_tqdm: bool = True) -> dict[str, Any]:
    """Time ``model.generate`` over static batches of ``requests`` (module docstring).

    Returns a dict: ``elapsed_time`` (s), ``useful_output_tokens`` (sum of output_len),
    ``generated_tokens`` (rows x batch max), ``useful_output_tokens_per_second``,
    ``generated_tokens_per_second``, ``requests_per_second``, ``num_batches``, settings.

    Raises:
        RuntimeError: a batch produced fewer tokens than requested.
    """
    import torch
    import transformers
    from tqdm.auto import tqdm

    pad = 0
    sample = {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0} if temperature > 0 \
        else {"do_sample": False}

    def generate(batch: Sequence[BenchRequest]) -> int:
        width = max(r.prompt_len for r in batch)
        new = max(r.output_len for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids, dtype=torch.long)
            mask[i, width - r.prompt_len:] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                                 min_new_tokens=new, pad_token_id=pad, **sample)
        got = out.shape[1] - width
        if got != new:
            raise RuntimeError(f"hf generate produced {got} new tokens, expected {new}")
        return got * len(batch)

    def sync() -> None:
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    batches = [list(requests[i:i + batch_size]) for i in range(0, len(requests), batch_size)]
    generate([BenchRequest(requests[0].prompt_token_ids, min(2, requests[0].output_len))])  # warm-up
    sync()
    generated = 0
    t0 = time.perf_counter()
    for batch in tqdm(batches, desc="HF static batches", disable=not use_tqdm, dynamic_ncols=True):
        generated += generate(batch)
    sync()
    elapsed = time.perf_counter() - t0
    useful = sum(r.output_len for r in requests)
    return {"name": "hf", "transformers": transformers.__version__,
            "attn_implementation": getattr(model.config, "_attn_implementation", None),
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "batch_size": batch_size,
            "num_batches": len(batches), "padding": "left", "sampling": sample, "elapsed_time": elapsed,
            "useful_output_tokens": useful, "generated_tokens": generated,
            "useful_output_tokens_per_second": useful / elapsed, "generated_tokens_per_second": generated / elapsed,
            "requests_per_second": len(requests) / elapsed}
