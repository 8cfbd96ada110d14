"""The driver side of a distributed replica, shared by the mp and Ray executors.

The driver keeps the scheduler, the KV allocator and the sampler; each step it flattens
the :class:`~kvforge.interfaces.SchedulerOutput` (:func:`~kvforge.distributed.protocol.encode_step`),
sends it to every worker, waits for all of them, and hands the output rank's logits to
the sampler as an :class:`~kvforge.engine.model_runner.ExecuteOutput`.

With async scheduling (:mod:`kvforge.engine.overlap`) the send and the wait are apart
(:meth:`DistributedExecutor.execute_deferred`). A transport that can deliver tokens
apart from a step (mp: ``_send_tokens``) lets the driver send step N+1 *before* it has
step N's logits: N+1's placeholder tokens travel later (:meth:`deliver_tokens`), and the
workers build N+1's inputs meanwhile, so they idle only while the driver receives step
N's logits, samples and sends the tokens. Otherwise (Ray) the driver samples step N
first and resolves N+1's placeholders itself. Steps are received in the order sent.

Failure policy: the ranks of a replica run in lock-step collectives, so one failed rank
leaves the others out of step. Any worker error, death or timeout therefore kills the
replica's workers and marks the executor dead; that step raises :class:`WorkerError`
(the engine ends the step's requests with ``finish_reason="error"``) and every later
step raises at once, so every request ends quickly with a clear error and nothing waits.

Interrupts (Ctrl-C during ``LLM.generate``) are not failures: the workers are fine, only
the driver stopped listening. Messages go out and come in whole
(:mod:`kvforge.distributed.interrupts`) and the transport counts the replies each rank
still owes, so the next call first resynchronizes (:meth:`DistributedExecutor._resync`):
a step still waiting for its placeholder tokens gets zeros, every owed reply is read and
dropped, and the steps sent before are abandoned (waiting on one raises). Only an
interrupt that tears a message (a second Ctrl-C while one is written) leaves the executor
dead, with a message that says so.
"""
from __future__ import annotations

import logging
from abc import abstractmethod
from typing import Any

import torch

from kvforge.distributed.interrupts import defer_sigint, is_interrupt
from kvforge.distributed.protocol import encode_step
from kvforge.distributed.runner_proxy import PendingExecute, _WorkerRunner
from kvforge.distributed.worker_sampling import ParamsTable
from kvforge.engine.executor import Executor
from kvforge.engine.profiling import span

log = logging.getLogger("kvforge.distributed")


class WorkerError(RuntimeError):
    """A worker of the replica failed; the executor is dead."""


class WorkerDiedError(WorkerError):
    """A worker process or actor exited."""


class WorkerTimeoutError(WorkerError):
    """Workers did not answer within ``parallel.worker_timeout_s``."""


class DistributedExecutor(Executor):
    """Driver of one replica's ``world_size`` workers (transport in subclasses).

    Args:
        config: the engine config (``max_num_batched_tokens`` already resolved).
        max_model_len: resolved by the builder.
        device: the driver's device (where the sampler runs).
    """

    def __init__(self, config, max_model_len: int, device: torch.device) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.device = device
        self.world_size = config.parallel.world_size
        self.timeout_s = config.parallel.worker_timeout_s
        self.dead: BaseException | None = None
        self.allocator = None
        self.output_rank = (config.parallel.pipeline_parallel_size - 1) * config.parallel.tensor_parallel_size
        self.runner = _WorkerRunner(self)
        self._out_buf: torch.Tensor | None = None
        self._in_flight = 0  # execute calls sent and not yet received (in order)
        self._tokens_owed = False  # the last step sent waits for the previous step's tokens
        self._owed_rows = 0  # how many tokens it waits for (rows of the previous step)
        self._interrupted = False  # an interrupt left a call half done: resync before the next
        self._epoch = 0  # bumped by a resync: steps sent before it are abandoned
        par = config.parallel
        why_not = ("the ray executor (use mp)" if not self.accepts_late_tokens else
                   "pipeline parallelism" if par.pipeline_parallel_size > 1 else
                   "synchronous scheduling (scheduler.async_scheduling is off)"
                   if not config.scheduler.async_scheduling else None)
        wanted = par.sample_on_worker if par.sample_on_worker is not None else device.type == "cuda"
        self.samples_on_worker = wanted and why_not is None
        if par.sample_on_worker and why_not is not None:
            log.info("parallel.sample_on_worker: not with %s; the driver samples", why_not)
        self._params = ParamsTable(capacity=max(4096, 4 * config.scheduler.max_num_seqs))
        self._last_sampled_on_worker = False  # the last step sent: its tokens stay on the GPUs
        self.num_steps_sampled_on_worker = 0

    # -- transport (subclasses) ---------------------------------------------------------
    @abstractmethod
    def _send_all(self, method: str, args: tuple) -> Any:
        """Start ``Worker.<method>(*args)`` on every rank; return a handle for :meth:`_recv_all`.
        Raises :class:`WorkerError` when a worker cannot be reached."""

    @abstractmethod
    def _recv_all(self, handle: Any, method: str, timeout: float) -> list[Any]:
        """Wait for the call started by :meth:`_send_all`; return the results by rank.
        Raises :class:`WorkerError` (or the remote ``ValueError`` while loading)."""

    def _call_all(self, method: str, args: tuple, timeout: float) -> list[Any]:
        return self._recv_all(self._send_all(method, args), method, timeout)

    @abstractmethod
    def _kill_workers(self) -> None:
        """Stop every worker now, without waiting for them."""

    def _drain(self, timeout: float) -> None:
        """Read and drop every reply the workers still owe (calls an interrupt left
        unreceived). Transports whose replies need no reading (Ray) keep this no-op."""

    def _share_output(self) -> bool:
        """Whether workers can hand the logits over through a buffer shared once."""
        return False

    def _send_tokens(self, tokens) -> None:
        """Send a waiting step its placeholder tokens (int64 numpy [N]).
        Only transports with :attr:`accepts_late_tokens` implement it."""
        raise NotImplementedError

    @property
    def accepts_late_tokens(self) -> bool:
        return type(self)._send_tokens is not DistributedExecutor._send_tokens

    # -- driver API ---------------------------------------------------------------------
    def call_all(self, method: str, *args, timeout: float | None = None) -> list[Any]:
        self._ready()
        self._no_call_in_flight(method)
        try:
            with defer_sigint():
                handle = self._send_all(method, args)
            return self._recv_all(handle, method, self.timeout_s if timeout is None else timeout)
        except BaseException as e:
            self._failed(e)
            raise

    def _no_call_in_flight(self, method: str) -> None:
        if self._in_flight:
            raise RuntimeError(f"{method!r} while {self._in_flight} step(s) are in flight: wait for them first")

    def _send_step(self, msg) -> Any:
        """Send an ``execute`` whose results :meth:`_recv_step` collects (in send order)."""
        self.check_health()
        if self._tokens_owed:
            raise RuntimeError("a step was sent before the previous one got its tokens (deliver_tokens)")
        try:
            with defer_sigint():  # the message and the counts that describe it, together
                handle = self._send_all("execute", (msg,))
                self._in_flight += 1
                self._tokens_owed = len(msg.ph_pos) > 0 and not msg.ph_on_device
                self._owed_rows = int(msg.ph_row.max()) + 1 if self._tokens_owed else 0
        except BaseException as e:
            self._failed(e)
            raise
        return handle

    def _recv_step(self, handle: Any, epoch: int) -> list[Any]:
        self.check_health()
        if epoch != self._epoch or self._interrupted:
            raise RuntimeError("this step was abandoned: an interrupt stopped the driver while it was in flight "
                               "and the workers were resynchronized")
        try:
            res = self._recv_all(handle, "execute", self.timeout_s)
            self._in_flight -= 1
        except BaseException as e:
            self._failed(e)
            raise
        return res

    def deliver_tokens(self, tokens: torch.Tensor) -> None:
        """Send the step in flight the previous step's sampled tokens (int64 [N], any
        device; reading them waits for the sampling). Nothing happens when no step waits."""
        if not self._tokens_owed:
            return
        if self.dead is not None:
            self._tokens_owed = False
            return
        try:
            with span("kvforge.send_tokens"):
                host = tokens.cpu().numpy()
                with defer_sigint():
                    self._send_tokens(host)
                    self._tokens_owed = False
        except BaseException as e:
            self._failed(e)
            raise

    def abandon_in_flight(self) -> None:
        """Give up every step sent and not yet received: the workers finish them (a step
        waiting for placeholder tokens gets zeros) and their replies are dropped; waiting on
        one later raises. The engine calls it after an interrupt stopped a step half way.

        Raises:
            WorkerError: the executor is dead, or died resynchronizing.
        """
        if self._in_flight or self._tokens_owed:
            self._interrupted = True
        self._ready()

    def check_health(self) -> None:
        if self.dead is not None:
            raise WorkerError(f"the distributed executor is dead ({type(self.dead).__name__}: {self.dead}); "
                              "rebuild the engine")

    def _ready(self) -> None:
        """Before a new call: healthy, and in step with the workers again after an interrupt."""
        self.check_health()
        if self._interrupted:
            self._resync()

    def _resync(self) -> None:
        """Bring the workers back in step after an interrupt left calls half done: a step
        waiting for its placeholder tokens gets zeros (its results are dropped with the
        rest: its requests were aborted or fail), then every reply owed is read and dropped.
        Interruptible (the next call resumes it); a worker error or timeout here is fatal."""
        log.warning("an interrupt stopped the driver mid-step: resynchronizing the %d workers", self.world_size)
        try:
            if self._tokens_owed:
                import numpy as np
                with defer_sigint():
                    self._send_tokens(np.zeros(self._owed_rows, dtype=np.int64))
                    self._tokens_owed = False
            self._drain(self.timeout_s)
        except BaseException as e:
            self._failed(e)
            raise
        self._in_flight = 0
        self._last_sampled_on_worker = False  # the workers' device tokens belong to a dropped step
        self._epoch += 1
        self._interrupted = False

    def _failed(self, exc: BaseException) -> None:
        """A call ended early: an interrupt is resynchronized by the next call; anything
        else kills the replica's workers."""
        if is_interrupt(exc):
            self._interrupted = True
        else:
            self._mark_dead(exc)

    def _mark_dead(self, exc: BaseException) -> None:
        if self.dead is None:
            self.dead = exc
            # (a ValueError is bad input, e.g. a checkpoint tensor a worker refused: the caller reports it, once)
            log.log(logging.INFO if isinstance(exc, ValueError) else logging.ERROR,
                    "distributed executor failed: %s: %s; stopping its workers", type(exc).__name__, exc)
            try:
                self._kill_workers()
            except Exception:  # noqa: BLE001
                log.exception("could not stop the workers")

    def start_profile(self, out_dir: str) -> None:
        """Start every worker's profiler (``out_dir`` absolute, already created).

        Raises:
            RuntimeError: a worker could not start it (those that did are stopped again;
                the replica keeps serving).
        """
        errors = [e for e in self.call_all("start_profile", out_dir) if e]
        if errors:
            self.call_all("stop_profile")
            raise RuntimeError(f"start_profile: {errors[0]}")

    def stop_profile(self) -> list[str]:
        return [p for p in self.call_all("stop_profile") if p]

    def load_model(self, timeout: float) -> list[dict]:
        """Every rank builds its model shard; returns their reports."""
        return self.call_all("load_model", timeout=timeout)

    def init_cache(self, allocator, num_blocks: int, num_cpu_blocks: int, timeout: float) -> None:
        self.allocator = allocator
        res = self.call_all("init_cache", num_blocks, num_cpu_blocks, self._share_output(), timeout=timeout)
        buf = res[self.output_rank]
        self._out_buf = buf if isinstance(buf, torch.Tensor) else None

    def execute(self, so, prev_tokens: torch.Tensor | None = None, prev_rows: dict[str, int] | None = None):
        """One step on the workers -> :class:`~kvforge.engine.model_runner.ExecuteOutput`.

        ``prev_tokens`` (int64 [N'], the previous step's sampled tokens, any device) and
        ``prev_rows`` (request id -> row there) resolve placeholder input tokens (async
        scheduling): reading them waits for that step's sampling on the driver's device.

        This synchronous path leaves no step in flight, so one found here was abandoned by
        an interrupt (anywhere between its send and its receive): resynchronize first."""
        if self._in_flight or self._tokens_owed:
            self._interrupted = True
        return self.execute_deferred(so, prev_tokens, prev_rows).wait()

    def execute_deferred(self, so, prev_tokens: torch.Tensor | None = None,
                         prev_rows: dict[str, int] | None = None,
                         sample_on_worker: bool = False) -> PendingExecute:
        """As :meth:`execute`, but return once the step is sent: the workers run it while
        the caller works; :meth:`PendingExecute.wait` collects the logits.

        ``sample_on_worker`` asks the workers to sample the step themselves when
        :attr:`samples_on_worker` and nothing in it needs the driver (prompt logprobs, draft
        verification, penalties, which read the token history). The output then carries
        ``sampled`` instead of logits, and the workers keep the tokens for the next step's
        placeholders."""
        self._ready()  # before the params table records entries this step would carry
        if self._tokens_owed:
            raise RuntimeError("a step was sent before the previous one got its tokens (deliver_tokens)")
        host = prev_tokens.tolist() if prev_tokens is not None else None
        msg, plan = encode_step(so, self.allocator, host, prev_rows)
        if len(msg.ph_pos) and not self.accepts_late_tokens:
            raise RuntimeError("this executor needs the previous step's tokens to send a step with placeholders")
        msg.ph_on_device = bool(len(msg.ph_pos)) and self._last_sampled_on_worker
        on_worker = (sample_on_worker and self.samples_on_worker and plan.num_sample_rows
                     and plan.num_sample_rows == len(plan.sample_requests) and not plan.prompt_slices
                     and not any(r.sampling_params.reads_history for r in plan.sample_requests))
        try:
            with defer_sigint():  # the params table changes only with the message that tells the workers
                if on_worker:
                    # Counts before this step's token (its placeholder is appended after the launch).
                    msg.sample = self._params.encode(plan.sample_requests,
                                                     [len(r.output_token_ids) for r in plan.sample_requests])
                handle = self._send_step(msg)
                self._last_sampled_on_worker = msg.sample is not None
                self.num_steps_sampled_on_worker += self._last_sampled_on_worker
                epoch = self._epoch
        except BaseException as e:
            if is_interrupt(e):  # (held back to here: the step went out, its handle is lost)
                self._interrupted = True
            raise
        return PendingExecute(plan.sample_requests, lambda: self._finish_execute(handle, plan, epoch),
                              bool(plan.prompt_slices))

    def _finish_execute(self, handle: Any, plan, epoch: int):
        from kvforge.engine.model_runner import ExecuteOutput
        with span("kvforge.recv_step"):
            res = self._recv_step(handle, epoch)
        out = res[self.output_rank]
        k = plan.num_sample_rows
        if out[0] == "sampled":
            empty = torch.empty((0, 0), dtype=torch.float32, device=self.device)
            return ExecuteOutput(empty, plan.sample_requests, {}, sampled=out[1])
        if out[0] == "sample_error":
            raise RuntimeError(f"sampling on the output worker failed: {out[1]}")
        n, data, slot = out
        if data is not None:
            logits = torch.from_numpy(data if data.flags.writeable else data.copy()).to(self.device)
        elif n:
            with span("kvforge.copy_logits"):
                logits = self._out_buf[slot, :n].to(self.device, copy=True)
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()  # read before the buffer is reused
        else:
            logits = torch.empty((0, 0), dtype=torch.float32, device=self.device)
        sample = logits[:k] if k else torch.empty((0, 0), dtype=torch.float32, device=self.device)
        prompt = {rid: (first, logits[k + off:k + off + cnt]) for rid, first, off, cnt in plan.prompt_slices}
        return ExecuteOutput(sample, plan.sample_requests, prompt)

    def shutdown(self) -> None:
        self._in_flight, self._tokens_owed, self._interrupted = 0, False, False  # the workers leave either way
        if self.dead is None:
            self.dead = RuntimeError("executor was shut down")
            try:
                self._shutdown_workers()
            except Exception:  # noqa: BLE001
                pass
            self._kill_workers()

    def _shutdown_workers(self) -> None:
        """Ask the workers to leave cleanly (best effort, short timeout)."""
        try:
            self._call_all("shutdown", (), 5.0)
        except BaseException:  # noqa: BLE001
            pass
