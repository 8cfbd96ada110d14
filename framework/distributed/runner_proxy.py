"""What the engine's step loop holds of a distributed replica (see
:mod:`kvforge.distributed.executor_base`): the ``ModelRunner`` surface it calls, forwarded
to the executor, and a step sent to the workers whose results are still to come."""
from __future__ import annotations

import torch


class _WorkerRunner:
    """The ``ModelRunner`` surface the engine's step loop calls, forwarded to the workers."""

    def __init__(self, executor) -> None:
        self._ex = executor
        self.graphs = None
        self.return_hidden_states = False
        self.kv_caches: list[torch.Tensor] = []  # held by the workers

    @property
    def allocator(self):
        return self._ex.allocator

    def execute(self, so, prev_tokens=None, prev_rows=None):
        return self._ex.execute(so, prev_tokens, prev_rows)

    def execute_deferred(self, so, prev_tokens=None, prev_rows=None, sample_on_worker=False) -> "PendingExecute":
        return self._ex.execute_deferred(so, prev_tokens, prev_rows, sample_on_worker)

    @property
    def accepts_late_tokens(self) -> bool:
        """Whether :meth:`execute_deferred` may be called before the previous step's
        tokens exist (then :meth:`deliver_tokens` sends them)."""
        return self._ex.accepts_late_tokens

    @property
    def samples_on_worker(self) -> bool:
        """Whether :meth:`execute_deferred` may have the workers sample (``parallel.sample_on_worker``)."""
        return self._ex.samples_on_worker

    def deliver_tokens(self, tokens) -> None:
        self._ex.deliver_tokens(tokens)

    def abandon_in_flight(self) -> None:
        """Drop every step sent and not yet received (after an interrupt), so that the
        workers are idle and in step again; see ``DistributedExecutor.abandon_in_flight``."""
        self._ex.abandon_in_flight()

    def swap(self, pairs, to_cpu: bool) -> None:
        if pairs:
            self._ex.call_all("swap", list(pairs), to_cpu)


class PendingExecute:
    """A step sent to the workers whose logits have not been received.

    Attributes:
        sample_requests: the requests the step samples, in row order (known at send time).
        has_prompt_logits: whether it returns prompt-logprob rows.
    """

    def __init__(self, sample_requests: list, finish, has_prompt_logits: bool = False) -> None:
        self.sample_requests = sample_requests
        self.has_prompt_logits = has_prompt_logits
        self._finish = finish
        self._out = None

    def wait(self):
        """Wait for the workers -> :class:`~kvforge.engine.model_runner.ExecuteOutput`
        (idempotent). Raises ``WorkerError`` as ``DistributedExecutor.execute``."""
        if self._out is None:
            self._out = self._finish()
        return self._out
