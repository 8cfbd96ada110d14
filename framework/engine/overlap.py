"""Async scheduling: the host prepares step N+1 while the device runs step N.

Without it every step is serial: the host waits for step N's sampled tokens, then
updates requests, detokenizes, schedules and builds step N+1's inputs while the GPU
idles (about 1.6 ms per step for an 8B model on an H200, a third of a batch-1 decode).
vLLM's ``--async-scheduling`` and SGLang's overlap scheduler remove that gap the same
way; this is kvforge's version.

One call of :meth:`OverlapStepper.step`:

1. schedule step N+1. A request whose step-N token is still on the device carries a
   placeholder (``PLACEHOLDER_TOKEN_ID``) as its last output token, so its length, the
   token budget and ``max_tokens`` are exact;
2. launch N+1: the runner uploads inputs with one non-blocking copy and fills the
   placeholder input ids from step N's sampled-token tensor on the device; the sampler
   queues the copy of N+1's tokens to pinned host memory;
3. finish step N on the host while the device runs N+1: wait for its tokens (long done),
   patch the placeholders, apply EOS / stop ids / stop strings, detokenize, emit;
4. advance step N+1's requests by a placeholder each (``Scheduler.update``), which also
   ends those that reach ``max_tokens``.

Outputs are identical to the synchronous loop; a step's outputs are returned one call
later. A request that hits EOS or a stop string in step N has already been scheduled in
N+1: that one token of compute is wasted and discarded. While a live request uses
repetition/frequency/presence penalties (which read the generated ids on the host), each
step's tokens are waited for before the next is scheduled.

With tensor/pipeline parallelism the runner is the workers' proxy
(:class:`~kvforge.distributed.executor_base.DistributedExecutor`): step 2 only *sends*
step N+1 (its placeholders resolved on the host from step N's tokens, which the driver
has by then); step 3 runs while the workers compute N+1; then the driver waits for N+1's
logits and queues their sampling, before step 4 (so sampling sees the requests as at
launch: seeded noise and ``min_tokens`` count the same tokens as in one process).

With speculative decoding, steps in which the adaptive rule drafts for some request run
synchronously (the drafter and the rejection sampler need every token on the host); the
steps in which speculation is off (large batches, low acceptance) overlap as above. The
engine switches per step (``LLMEngine.step``), draining the in-flight step first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvforge.engine.outputs import RequestOutput
from kvforge.engine.request import PLACEHOLDER_TOKEN_ID, Request, RequestStatus, apply_stop_string, check_stop
from kvforge.engine.sampler import PendingSamplerOutput
from kvforge.interfaces import SchedulerOutput


@dataclass
class _Inflight:
    """A launched step whose sampled tokens have not been processed on the host."""

    requests: list[Request]  # sampled requests, in row order
    rows: dict[str, int]  # request_id -> row in sample.token_ids
    sample: PendingSamplerOutput | None  # None while ``pending``
    pending: Any = None  # PendingExecute: sent to the workers, logits not yet received
    so: SchedulerOutput | None = None  # the step (to fail its requests if its wait fails)


class OverlapStepper:
    """Runs :class:`~kvforge.engine.llm_engine.LLMEngine` steps with async scheduling."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.inflight: _Inflight | None = None
        self.num_overlapped_steps = 0  # steps launched before the previous step's tokens were read

    def step(self) -> list[RequestOutput]:
        e = self.engine
        results, e._pending = e._pending, []
        touched: dict[str, None] = {}
        prev = self.inflight
        if prev is not None and e._needs_history:
            self._process(prev, touched)  # penalties read the real ids: no placeholder may be live
            prev = self.inflight = None
        so = e.scheduler.schedule()
        for req in so.finished:
            touched[req.parent_id] = None
        if e.spec is not None:
            for req in so.preempted:  # its drafter state restarts from scratch
                e.spec.free(req)
        if not so.scheduled and (so.swap_out or so.swap_in):
            e.runner.swap(so.swap_out, to_cpu=True)
        launched = self._launch(so, prev, touched)
        if prev is not None:
            self._process(prev, touched)
        if launched is not None and launched.pending is not None:
            launched = self._complete(launched, touched)
        if so.scheduled:
            placeholder = [PLACEHOLDER_TOKEN_ID]
            sampled = {r.request_id: placeholder for r in launched.requests} if launched else {}
            e.scheduler.update(so, sampled)  # skips requests step N just finished
            if launched is not None:
                for r in launched.requests:
                    if r.output_token_ids and r.output_token_ids[-1] == PLACEHOLDER_TOKEN_ID \
                            and not r.num_pending_tokens:
                        r.num_pending_tokens = 1
        self.inflight = launched
        e._emit_touched(touched, results)
        return results

    def drain(self) -> None:
        """Finish the in-flight step on the host (its outputs go to the next ``step()``), so
        that every token is known before a synchronous step (speculative verification)."""
        if self.inflight is None:
            return
        touched: dict[str, None] = {}
        self._process(self.inflight, touched)
        self.inflight = None
        self.engine._emit_touched(touched, self.engine._pending)

    def _launch(self, so: SchedulerOutput, prev: _Inflight | None, touched: dict[str, None]) -> _Inflight | None:
        e = self.engine
        if not so.scheduled:
            return None
        if prev is not None:
            self.num_overlapped_steps += 1
        prev_tokens, prev_rows = (prev.sample.token_ids, prev.rows) if prev else (None, None)
        deferred = getattr(e.runner, "execute_deferred", None)
        if deferred is not None:  # workers: send now, wait at the start of the next step
            try:
                pend = deferred(so, prev_tokens, prev_rows)
            except Exception as err:
                e._fail_step(so, err, touched)
                return None
            reqs = pend.sample_requests
            return _Inflight(reqs, {r.request_id: i for i, r in enumerate(reqs)}, None, pend, so)
        try:
            ex = e.runner.execute(so, prev_tokens, prev_rows)
            e._record_prompt_logprobs(ex)
            if not ex.sample_requests:
                return None
            sample = e.sampler.sample_async(ex.logits, ex.sample_requests)
            if e.spec is not None:  # hidden states an EAGLE-style drafter holds are now one step old
                e.spec.forget_hidden(ex.sample_requests)
            return _Inflight(ex.sample_requests, {r.request_id: i for i, r in enumerate(ex.sample_requests)}, sample)
        except Exception as err:  # fails this step's requests only, as in the synchronous loop
            e._fail_step(so, err, touched)
            return None

    def _complete(self, sent: _Inflight, touched: dict[str, None]) -> _Inflight | None:
        """Wait for a sent step's logits and queue their sampling (before the step's
        placeholders are added). Returns the in-flight step, or None when it samples
        nothing or failed (then its requests end with ``finish_reason="error"``, as in a
        failed launch)."""
        e = self.engine
        try:
            ex = sent.pending.wait()
            e._record_prompt_logprobs(ex)
            sent.pending = None
            if not ex.sample_requests:
                return None
            sent.sample = e.sampler.sample_async(ex.logits, ex.sample_requests)
            return sent
        except Exception as err:
            e._fail_step(sent.so, err, touched)
            return None

    def _process(self, done: _Inflight, touched: dict[str, None]) -> None:
        """Patch a finished step's placeholders with its tokens and apply every stop rule."""
        e = self.engine
        out = done.sample.result()
        stopped = RequestStatus.FINISHED_STOPPED
        for i, req in enumerate(done.requests):
            # No placeholder: ended (abort, error, stop) before this token was known.
            if not req.num_pending_tokens or e.outputs.parent_of(req.request_id) is None:
                continue
            req.output_token_ids[-1] = out.sampled_token_ids[i]  # nothing is appended while pending
            req.num_pending_tokens = 0
            touched[req.parent_id] = None
            status = check_stop(req, e.max_model_len)
            if status is stopped:  # EOS / stop id; takes precedence over max_tokens, as in vLLM
                if not req.is_finished:
                    e.scheduler.finish_requests([req.request_id], stopped)
                elif req.status is RequestStatus.FINISHED_LENGTH_CAPPED:
                    req.status = stopped
            stop = e.outputs.process_tokens(req, 1, [out.logprobs[i]], [out.sampled_logprobs[i]])
            if stop is not None:
                apply_stop_string(e.scheduler, req, stop)
