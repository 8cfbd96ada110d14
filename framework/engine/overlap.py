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
step N+1, before step N's logits have come back; then the driver receives N's logits,
samples them and sends the workers N's tokens for N+1's placeholders (the workers built
N+1's inputs meanwhile), and step 3 runs while the workers compute N+1. Sampling is
given each request's output count from launch time, so seeded noise and ``min_tokens``
see the same positions as in one process. (With a transport that cannot send tokens
apart from a step, Ray, N is received and sampled before N+1 is sent.)

With speculative decoding, steps in which the adaptive rule drafts for some request run
synchronously (the drafter and the rejection sampler need every token on the host); the
steps in which speculation is off (large batches, low acceptance) overlap as above. The
engine switches per step (``LLMEngine.step``), draining the in-flight step first.

An interrupt (Ctrl-C in ``LLM.generate``) can stop a call anywhere, with steps sent and
their tokens unknown. The next call first recovers (:meth:`OverlapStepper._recover`): the
steps left on the workers are abandoned (the executor resynchronizes them), a step whose
tokens had reached the host is finished as usual, and a request left waiting for a lost
token ends with an error (``LLM.generate`` has already aborted its own requests).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvforge.engine.outputs import RequestOutput
from kvforge.engine.profiling import span
from kvforge.engine.request import (
    PLACEHOLDER_TOKEN_ID,
    Request,
    RequestStatus,
    apply_stop_string,
    check_stop,
    drop_placeholders,
)
from kvforge.engine.sampler import PendingSamplerOutput
from kvforge.engine.schedule_check import checked_update
from kvforge.interfaces import SchedulerOutput


class SampledOnWorker:
    """A step the workers sampled: its :class:`~kvforge.engine.sampler.SamplerOutput`
    arrived with the step (the surface of ``PendingSamplerOutput`` the stepper uses)."""

    def __init__(self, out) -> None:
        self._out = out

    @property
    def token_ids(self) -> torch.Tensor:
        """int64 [N] on the host (only read when a later step is launched after this one
        completed, to inline its tokens)."""
        return torch.tensor(self._out.sampled_token_ids, dtype=torch.int64)

    def result(self):
        return self._out


@dataclass
class _Inflight:
    """A launched step whose sampled tokens have not been processed on the host."""

    requests: list[Request]  # sampled requests, in row order
    rows: dict[str, int]  # request_id -> row in sample.token_ids
    sample: PendingSamplerOutput | None  # None while ``pending``
    pending: Any = None  # PendingExecute: sent to the workers, logits not yet received
    so: SchedulerOutput | None = None  # the step (to fail its requests if its wait fails)
    generated: list[int] | None = None  # per request, output tokens before this step's (at launch)


class OverlapStepper:
    """Runs :class:`~kvforge.engine.llm_engine.LLMEngine` steps with async scheduling."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.inflight: _Inflight | None = None
        self.num_overlapped_steps = 0  # steps launched before the previous step's tokens were read
        self._interrupted: str | None = None  # what stopped a step() or drain() half way (KeyboardInterrupt)

    def step(self) -> list[RequestOutput]:
        if self._interrupted:
            self._recover()
        try:
            return self._step()
        except BaseException as err:
            if not isinstance(err, Exception):  # KeyboardInterrupt: the state is half updated
                self._interrupted = type(err).__name__
            raise

    def _step(self) -> list[RequestOutput]:
        e = self.engine
        results, e._pending = e._pending, []
        touched: dict[str, None] = {}
        prev = self.inflight
        if prev is not None and e._needs_history:
            prev = self._complete(prev, touched)
            if prev is not None:
                self._process(prev, touched)  # penalties read the real ids: no placeholder may be live
            prev = self.inflight = None
        if prev is not None and prev.pending is not None and not getattr(e.runner, "accepts_late_tokens", False):
            prev = self.inflight = self._complete(prev, touched)  # its tokens go into the next step's message
        with span("kvforge.schedule"):
            so = e.schedule()
        for req in so.finished:
            touched[req.parent_id] = None
        if e.spec is not None:
            for req in so.preempted:  # its drafter state restarts from scratch
                e.spec.free(req)
        if not so.scheduled and (so.swap_out or so.swap_in):
            if prev is not None and prev.pending is not None:  # workers take no other call meanwhile
                prev = self.inflight = self._complete(prev, touched)
            e.runner.swap(so.swap_out, to_cpu=True)
        with span("kvforge.launch"):
            launched = self._launch(so, prev, touched)
        if prev is not None:
            with span("kvforge.complete"):
                prev = self._complete(prev, touched)  # (workers: N's logits, sampled; tokens sent on)
        if launched is not None and launched.pending is not None \
                and (e._needs_history or launched.pending.has_prompt_logits):
            # Penalties read the generated ids, prompt logprobs go out with the request's
            # next output: receive and sample before this step's placeholders exist.
            launched = self._complete(launched, touched)
        if prev is not None:
            with span("kvforge.process"):
                self._process(prev, touched)
            self.inflight = None  # done with: _recover must not process it again
        if so.scheduled:
            placeholder = [PLACEHOLDER_TOKEN_ID]
            sampled = {r.request_id: placeholder for r in launched.requests} if launched else {}
            checked_update(e.scheduler, e._scheduler_who, so, sampled)  # skips requests step N just finished
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
        if self._interrupted:
            self._recover()
        if self.inflight is None:
            return
        touched: dict[str, None] = {}
        try:
            done = self._complete(self.inflight, touched)
            if done is not None:
                self._process(done, touched)
        except BaseException as err:
            if not isinstance(err, Exception):
                self._interrupted = type(err).__name__
            raise
        self.inflight = None
        self.engine._emit_touched(touched, self.engine._pending)

    def _recover(self) -> None:
        """Start clean after an interrupt (module docstring): abandon the steps on the
        workers, finish a step whose tokens are on the host, and end with an error every
        request still waiting for a token that is lost (its KV blocks return)."""
        e = self.engine
        touched: dict[str, None] = {}
        abandon = getattr(e.runner, "abandon_in_flight", None)
        if abandon is not None:
            try:
                abandon()
            except Exception:  # noqa: BLE001 - a dead executor fails every later step with its cause
                pass
        prev = self.inflight
        if prev is not None and prev.pending is None and prev.sample is not None:
            self._process(prev, touched)  # (its requests the caller aborted are skipped)
        self.inflight = None
        err = f"engine error: interrupted ({self._interrupted}) before this token was sampled"
        for parent in list(e.outputs.parents.values()):
            for child in parent.children:
                r = child.request
                if not r.num_pending_tokens:
                    continue
                drop_placeholders(r)
                if not r.is_finished:
                    e.scheduler.finish_requests([r.request_id], RequestStatus.FINISHED_ERROR)
                else:  # finished at launch (max_tokens), its last token lost
                    r.status = RequestStatus.FINISHED_ERROR
                r.error = err
                touched[r.parent_id] = None
        e._emit_touched(touched, e._pending)
        self._interrupted = None

    def _launch(self, so: SchedulerOutput, prev: _Inflight | None, touched: dict[str, None]) -> _Inflight | None:
        e = self.engine
        if not so.scheduled:
            return None
        if prev is not None:
            self.num_overlapped_steps += 1
        prev_tokens = prev.sample.token_ids if prev is not None and prev.sample is not None else None
        prev_rows = prev.rows if prev is not None else None
        deferred = getattr(e.runner, "execute_deferred", None)
        if deferred is not None:  # workers: send now, receive in the next call
            # The workers may sample it themselves unless sampling reads the token history.
            on_worker = getattr(e.runner, "samples_on_worker", False) and not e._needs_history and e.spec is None
            try:
                pend = deferred(so, prev_tokens, prev_rows, on_worker)
            except Exception as err:
                e._fail_step(so, err, touched)
                return None
            reqs = pend.sample_requests
            return _Inflight(reqs, {r.request_id: i for i, r in enumerate(reqs)}, None, pend, so,
                             [len(r.output_token_ids) for r in reqs])
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
        """Receive a sent step's logits, queue their sampling and pass the tokens to a
        step that waits for them. Returns the step, or None when it samples nothing or
        failed. No-op for a step that was sampled at launch.

        On failure the step's requests end with ``finish_reason="error"`` (also one that
        had already reached ``max_tokens`` with this step's token still pending), and a
        step waiting for the tokens gets zeros in their place: it still runs, so the KV it
        writes for its other requests is real (blocks it completes may enter the prefix
        cache); what it computes for the failed requests is discarded with them."""
        if sent.pending is None:
            return sent
        e = self.engine
        deliver = getattr(e.runner, "deliver_tokens", None)
        try:
            ex = sent.pending.wait()
            sent.pending = None
            e._record_prompt_logprobs(ex)
            if not ex.sample_requests:
                return None
            if ex.sampled is not None:  # sampled on the workers; they hold the tokens
                sent.sample = SampledOnWorker(ex.sampled)
                return sent
            sent.sample = e.sampler.sample_async(ex.logits, ex.sample_requests, sent.generated)
            if deliver is not None:
                deliver(sent.sample.token_ids)
            return sent
        except Exception as err:
            sent.pending = None
            if deliver is not None:
                try:
                    deliver(torch.zeros(len(sent.requests), dtype=torch.int64))
                except Exception:  # noqa: BLE001 - the executor is dead: every later step fails anyway
                    pass
            self._fail_sent(sent, err, touched)
            return None

    def _fail_sent(self, sent: _Inflight, err: Exception, touched: dict[str, None]) -> None:
        e = self.engine
        capped = [r for r in sent.requests if r.num_pending_tokens and r.is_finished]  # max_tokens at launch
        for r in sent.requests:
            drop_placeholders(r)
        # Only its live requests: one that ended meanwhile may share its id with a new one.
        sent.so.scheduled = [r for r in sent.so.scheduled if not r.is_finished]
        e._fail_step(sent.so, err, touched)
        for r in capped:  # finished, but not reported yet: its last token is lost
            if e.outputs.parent_of(r.request_id) is not None:
                r.status = RequestStatus.FINISHED_ERROR
                r.error = f"engine error: {type(err).__name__}: {err}"
                touched[r.parent_id] = None

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
