"""Synthetic offline-benchmark workloads, as token ids (no tokenizer involved).

Two datasets, named as in vLLM's benchmark CLI:

* ``random`` — every prompt has ``input_len`` tokens and asks for ``output_len`` tokens. With
  ``range_ratio`` r > 0 each length is instead drawn uniformly from the integers in
  ``[int(N * (1 - r)), int(N * (1 + r))]`` (vLLM's ``--random-range-ratio``).
* ``variable`` — input and output lengths each drawn uniformly from the integers in
  ``[min_len, max_len]`` (both ends included); e.g. the issue's "256 sequences, input and output
  lengths uniform in [100, 1024], seed 0". Without ``min_len``/``max_len`` the bounds come from
  ``input_len``/``output_len`` and ``range_ratio`` as above.

Determinism: one ``numpy.random.default_rng(seed)`` draws, in this order, all input lengths, all
output lengths, then all prompt token ids (uniform in ``[0, vocab_size)``). The lengths therefore
depend only on (dataset, num_prompts, bounds, seed), not on the model's vocabulary.
Prompt ids are arbitrary: the benchmarks set ``ignore_eos`` so every request generates exactly its
``output_len`` tokens, whatever the weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DATASETS = ("random", "variable")


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request: prompt token ids (ints in ``[0, vocab)``) and tokens to generate."""

    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def ratio_bounds(n: int, range_ratio: float) -> tuple[int, int]:
    """``[int(n*(1-r)), int(n*(1+r))]``, at least 1 (vLLM's random-dataset range).

    Raises:
        ValueError: ``n`` < 1 or ``range_ratio`` outside [0, 1).
    """
    if n < 1:
        raise ValueError(f"length must be >= 1, got {n}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    return max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio)))


def sample_lengths(dataset: str, num_prompts: int, input_len: int, output_len: int, seed: int = 0,
                   range_ratio: float = 0.0, min_len: int | None = None,
                   max_len: int | None = None) -> tuple[list[int], list[int]]:
    """Input and output lengths (tokens) of every request, as the module docstring defines.

    Raises:
        ValueError: unknown dataset, num_prompts < 1, bad bounds, or ``variable`` with no bounds
            (neither min_len/max_len nor range_ratio).
    """
    return _lengths(np.random.default_rng(seed), dataset, num_prompts, input_len, output_len, range_ratio,
                    min_len, max_len)


def _lengths(rng: np.random.Generator, dataset: str, num_prompts: int, input_len: int, output_len: int,
             range_ratio: float, min_len: int | None, max_len: int | None) -> tuple[list[int], list[int]]:
    if dataset not in DATASETS:
        raise ValueError(f"--dataset {dataset!r}: expected one of {', '.join(DATASETS)}")
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    if (min_len is None) != (max_len is None):
        raise ValueError("--min-len and --max-len go together")
    if min_len is not None and dataset != "variable":
        raise ValueError("--min-len/--max-len apply to --dataset variable")
    if min_len is not None:
        if not 1 <= min_len <= max_len:
            raise ValueError(f"need 1 <= --min-len <= --max-len, got [{min_len}, {max_len}]")
        in_b = out_b = (min_len, max_len)
    else:
        if dataset == "variable" and range_ratio == 0:
            raise ValueError("--dataset variable needs --min-len/--max-len or --range-ratio > 0")
        in_b, out_b = ratio_bounds(input_len, range_ratio), ratio_bounds(output_len, range_ratio)
    ins = rng.integers(in_b[0], in_b[1] + 1, size=num_prompts)
    outs = rng.integers(out_b[0], out_b[1] + 1, size=num_prompts)
    return [int(x) for x in ins], [int(x) for x in outs]


def make_requests(dataset: str, num_prompts: int, input_len: int, output_len: int, vocab_size: int,
                  seed: int = 0, range_ratio: float = 0.0, min_len: int | None = None,
                  max_len: int | None = None) -> list[BenchRequest]:
    """The benchmark's requests: lengths from :func:`sample_lengths`, then random prompt ids.

    Raises:
        ValueError: as :func:`sample_lengths`, or ``vocab_size`` < 1.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    rng = np.random.default_rng(seed)
    ins, outs = _lengths(rng, dataset, num_prompts, input_len, output_len, range_ratio, min_len, max_len)
    ids = rng.integers(0, vocab_size, size=sum(ins)).tolist()
    out, pos = [], 0
    for n, m in zip(ins, outs):
        out.append(BenchRequest(ids[pos:pos + n], m))
        pos += n
    return out


def summarize(requests: list[BenchRequest]) -> dict[str, float | int]:
    """Token counts and length ranges of a workload (for the JSON report)."""
    ins = [r.prompt_len for r in requests]
    outs = [r.output_len for r in requests]
    return {"num_requests": len(requests), "total_input_tokens": sum(ins), "total_output_tokens": sum(outs),
            "input_len_min": min(ins), "input_len_mean": sum(ins) / len(ins), "input_len_max": max(ins),
            "output_len_min": min(outs), "output_len_mean": sum(outs) / len(outs), "output_len_max": max(outs)}
