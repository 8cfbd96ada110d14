"""Sampling on the output worker, so that a tensor-parallel decode loop never waits on the host.

Without it each step's logits travel to the driver, which samples and sends the tokens
back before the workers can start the next step: the GPUs idle for that round trip every
step (measured on two H200s: ~1-2 ms a step, as much as the halved forward saves). With it
(``parallel.sample_on_worker``, the design of vLLM V1's async scheduling) the output rank
samples right after the forward with the same :class:`~kvforge.engine.sampler.Sampler`,
broadcasts the tokens to the other tensor-parallel ranks on the GPU, and each rank writes
them into the next step's placeholder inputs on the device. The driver receives token ids
and logprobs (no logits) one step behind, and only for bookkeeping.

What a worker needs to sample a row is the request's :class:`SamplingParams`, its EOS ids
(``min_tokens``), its completion index (seeded noise) and how many tokens it has generated.
The params cross once per request (each request holds its own snapshot, taken by
``LLMEngine.prepare_request``, shared by its ``n`` completions): the driver's
:class:`ParamsTable` gives each params object a small handle, sends the new ones with a
step and tells the workers which to forget (least recently used, past ``capacity``);
:class:`WorkerSampler` mirrors it. Rows whose sampling reads the token history (penalties) never come here: the engine
samples those steps on the driver.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


FAIL_ENV = "KVFORGE_TEST_FAIL_WORKER_SAMPLE"


@dataclass
class WorkerSample:
    """The sampling part of a :class:`~kvforge.distributed.protocol.StepMessage`.

    Attributes:
        handles: int64 [R] the params handle of each sampling row (rows in step order).
        index: int64 [R] each row's completion index (``Request.index``; seeded noise).
        num_generated: int64 [R] output tokens before the one sampled now.
        new: handle -> (SamplingParams, EOS token ids) first used by this step.
        drop: handles the workers forget before this step.
    """

    handles: np.ndarray
    index: np.ndarray
    num_generated: np.ndarray
    new: dict[int, tuple[Any, frozenset]] = field(default_factory=dict)
    drop: list[int] = field(default_factory=list)


def sampler_view(sp):
    """A copy of ``sp`` with only what the sampler reads: ``extra_args`` (any object a
    plugin put there, maybe not picklable) and the stop strings stay on the driver."""
    return sp.clone(extra_args={}, stop=None)


class ParamsTable:
    """Driver side: handles for the (params, EOS ids) the workers hold.

    Args:
        capacity: entries kept before the least recently used are dropped (a step's own
            rows are never dropped, so a step may briefly exceed it).
    """

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        # (id(params), eos) -> (handle, params): the strong reference keeps id() unique, and
        # each request holds its own copy (LLMEngine.prepare_request), so no entry goes stale.
        self._entries: OrderedDict[tuple[int, frozenset], tuple[int, Any]] = OrderedDict()
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries)

    def encode(self, requests: list, num_generated: list[int]) -> WorkerSample:
        """The :class:`WorkerSample` of ``requests`` (the step's sampling rows, in order)."""
        handles = np.empty(len(requests), dtype=np.int64)
        new: dict[int, tuple[Any, frozenset]] = {}
        for i, r in enumerate(requests):
            key = (id(r.sampling_params), r.eos_token_ids)
            hit = self._entries.get(key)
            if hit is None:
                hit = (self._next, r.sampling_params)
                self._next += 1
                self._entries[key] = hit
                new[hit[0]] = (sampler_view(r.sampling_params), r.eos_token_ids)
            else:
                self._entries.move_to_end(key)
            handles[i] = hit[0]
        drop = []
        in_step = set(handles.tolist())
        while len(self._entries) > self.capacity:
            key, (h, _) = next(iter(self._entries.items()))
            if h in in_step:  # only this step's entries are left beyond capacity
                break
            del self._entries[key]
            drop.append(h)
        return WorkerSample(handles, np.asarray([r.index for r in requests], dtype=np.int64),
                            np.asarray(num_generated, dtype=np.int64), new, drop)


@dataclass
class _Row:
    """What :class:`~kvforge.engine.sampler.Sampler` reads of a request."""

    sampling_params: Any
    eos_token_ids: frozenset
    index: int
    generator: torch.Generator | None
    output_token_ids: tuple = ()  # never read: counts come as num_generated


class WorkerSampler:
    """Output-worker side: the driver's params, and a sampler on this rank's device.

    Args:
        vocab_size: the tokenizer's vocabulary (as the driver's sampler).
        device: where the logits are.
        seed: the engine's seed (``model.seed``) for rows without their own.
    """

    def __init__(self, vocab_size: int, device: torch.device, seed: int) -> None:
        from kvforge.engine.sampler import Sampler
        self.params: dict[int, tuple[Any, frozenset]] = {}
        self.sampler = Sampler(vocab_size, torch.Generator(device=device).manual_seed(seed))
        self.device = device
        self._seeded_gen: torch.Generator | None = None  # re-seeded per row (position-keyed noise)
        # Test hook: the N-th sample call raises (the per-step failure path, tests/test_distributed_async.py).
        self._fail_at = int(os.environ.get(FAIL_ENV, "0") or 0)
        self._calls = 0

    def update(self, ws: WorkerSample) -> None:
        """Apply the table changes a step carries (before sampling it).

        Raises:
            RuntimeError: a handle the driver never sent (the tables are out of step).
        """
        for h in ws.drop:
            self.params.pop(h, None)
        self.params.update(ws.new)
        missing = [int(h) for h in ws.handles if int(h) not in self.params]
        if missing:
            raise RuntimeError(f"worker sampling: unknown params handles {missing[:4]}")

    def sample(self, logits: torch.Tensor, ws: WorkerSample):
        """Sample the step's rows -> :class:`~kvforge.engine.sampler.PendingSamplerOutput`
        (tokens on the device, their copy to the host queued).

        Args:
            logits: float32 [R, V] the sampling rows' logits, in ``ws`` row order.
        """
        self._calls += 1
        if self._calls == self._fail_at:
            raise RuntimeError(f"injected worker sampling failure (call {self._calls}, {FAIL_ENV})")
        rows = []
        for h, idx in zip(ws.handles.tolist(), ws.index.tolist()):
            sp, eos = self.params[h]
            gen = None
            if sp.seed is not None:
                if self._seeded_gen is None:
                    self._seeded_gen = torch.Generator(device=self.device)
                gen = self._seeded_gen
            rows.append(_Row(sp, eos, idx, gen))
        return self.sampler.sample_async(logits, rows, ws.num_generated.tolist())
