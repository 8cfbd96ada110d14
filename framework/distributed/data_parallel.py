"""Data parallelism: several engine replicas behind one engine-shaped front end.

:class:`DataParallelEngine` has the surface ``LLM`` and ``AsyncLLMEngine`` drive
(``prepare_request``/``enqueue``/``add_request``, ``abort_request``, ``step``,
``has_unfinished_requests``, ``stats``, ``tokenizer``), so ``LLM(...,
data_parallel_size=2)`` and the server work unchanged. Each replica is a whole
:class:`~kvforge.engine.llm_engine.LLMEngine` (its own scheduler, KV cache and, with
``tensor/pipeline_parallel_size > 1``, its own workers) running in its own process:

* ``ray`` backend: a Ray actor in a placement group of its own (``world_size`` bundles;
  the replica's workers, if any, run in the same group), so replicas spread over the
  cluster's nodes;
* ``mp`` backend: a local process; on GPU replica i sees GPUs
  ``[i * world_size, (i + 1) * world_size)``.

Balancing: a new request goes to the live replica with the lowest load
``in_flight / max_num_seqs + kv_cache_usage`` (in-flight requests counted by the front end
as they are routed, KV usage as reported after each step), ties to the lowest index.
``step()`` steps every replica that has work, concurrently, and merges their outputs.

A replica that dies ends its requests with ``finish_reason="error"`` and takes no new
ones; the others keep serving.

Interrupts (Ctrl-C in ``LLM.generate``) stop only the front end; the replicas ignore SIGINT
and answer every call. The front end keeps each replica's calls whose answers it has not
read (:class:`_Call`, in order) and reads an answer and applies it (a step's finished
requests, an add's routing) with SIGINT held back, so an interrupted call's answer is
read and applied before the replica's next call: no answer is taken for another's, and no
request or KV block is lost.
"""
from __future__ import annotations

import functools
import logging
import os
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from kvforge.distributed.interrupts import defer_sigint
from kvforge.distributed.replicas import ReplicaDiedError, _ProcReplica, _RayReplica
from kvforge.engine.outputs import CompletionOutput, RequestOutput

log = logging.getLogger("kvforge.distributed")


@dataclass
class PreparedDPRequest:
    request_id: str
    prompt: Any
    params: Any
    priority: int


class _Call:
    """A call sent to a replica whose answer has not been read yet.

    ``on_reply(value, error)`` runs when the answer is read, whichever later call reads it."""

    __slots__ = ("handle", "on_reply", "done", "value", "error")

    def __init__(self, handle, on_reply: Callable[[Any, BaseException | None], None] | None) -> None:
        self.handle, self.on_reply = handle, on_reply
        self.done, self.value, self.error = False, None, None


class DataParallelEngine:
    """``data_parallel_size`` replicas behind the engine API (see module docstring).

    Raises:
        ValueError: a replica's build error (bad config, bad model).
    """

    def __init__(self, config) -> None:
        from kvforge.engine.tokenizer import load_tokenizer
        config = config.model_copy(deep=True)
        self.config = config
        n = config.parallel.data_parallel_size
        backend = config.parallel.distributed_executor_backend or "mp"
        cls = _RayReplica if backend == "ray" else _ProcReplica
        self.timeout_s = config.parallel.worker_timeout_s
        self.replicas: list[Any] = []
        try:
            for i in range(n):
                self.replicas.append(cls(config, i))
            handles = [r.submit("info") for r in self.replicas]
            infos = [r.result(h, 1800.0) for r, h in zip(self.replicas, handles)]
        except BaseException:
            self.shutdown()
            raise
        self.replica_info = infos
        self.max_model_len = infos[0]["max_model_len"]
        self.vocab_size = infos[0]["vocab_size"]
        self.max_num_seqs = infos[0]["max_num_seqs"]
        self.choices = {**infos[0]["choices"], "data_parallel": f"{n} x {backend}"}
        self.tokenizer = load_tokenizer(config.model.tokenizer or config.model.model)
        self.alive = [True] * n
        self.in_flight = [0] * n
        self.num_routed = [0] * n  # requests each replica has been given
        self.kv_usage = [0.0] * n
        self._stats: list[dict[str, float]] = [{} for _ in range(n)]
        self._owner: dict[str, int] = {}
        self._pending: list[RequestOutput] = []
        self._calls: list[deque[_Call]] = [deque() for _ in range(n)]  # per replica, answers unread
        log.info("data parallel: %d replicas (%s), %s", n, backend, self.choices)

    # -- routing --------------------------------------------------------------------------
    def choose_replica(self) -> int:
        """The live replica with the lowest ``in_flight / max_num_seqs + kv_cache_usage``."""
        live = [i for i, ok in enumerate(self.alive) if ok]
        if not live:
            raise RuntimeError("data parallel: every replica has died")
        return min(live, key=lambda i: (self.in_flight[i] / self.max_num_seqs + self.kv_usage[i], i))

    def _call(self, i: int, method: str, *args):
        try:
            return self._result(i, self._submit(i, method, *args))
        except ReplicaDiedError as e:
            self._replica_died(i, e)
            raise RuntimeError(f"data-parallel replica {i} died: {e}") from None

    # -- calls (in order per replica; answers survive interrupts) ---------------------------
    def _submit(self, i: int, method: str, *args, on_reply=None, on_sent=None) -> _Call:
        """Send a call to replica ``i`` once the answers to its earlier calls are read;
        ``on_sent`` runs with the send, uninterrupted. Raises ReplicaDiedError."""
        self._drain(i)
        if not self.alive[i]:
            raise ReplicaDiedError(f"replica {i} has died")
        try:
            with defer_sigint():
                call = _Call(self.replicas[i].submit(method, *args), on_reply)
                self._calls[i].append(call)
                if on_sent is not None:
                    on_sent()
        except ReplicaDiedError as e:
            self._lost(i, e)
            raise
        return call

    def _result(self, i: int, call: _Call, timeout: float | None = None):
        """``call``'s answer (read after the older ones), or raise its error."""
        while not call.done:
            self._read_one(i, timeout)
        if call.error is not None:
            raise call.error
        return call.value

    def _drain(self, i: int) -> None:
        while self._calls[i]:
            self._read_one(i)

    def _read_one(self, i: int, timeout: float | None = None) -> None:
        """Wait (interruptibly) for replica ``i``'s oldest unread answer, then read and apply it."""
        call, r = self._calls[i][0], self.replicas[i]
        try:
            r.wait(call.handle, self.timeout_s if timeout is None else timeout)
        except ReplicaDiedError as e:
            self._lost(i, e)
            return
        with defer_sigint():
            try:
                call.value = r.take(call.handle)
            except ReplicaDiedError as e:
                self._lost(i, e)
                return
            except Exception as e:  # noqa: BLE001 - the replica's own error: the caller's to raise
                call.error = e
            self._calls[i].popleft()
            call.done = True
            if call.on_reply is not None:
                call.on_reply(call.value, call.error)

    def _lost(self, i: int, err: ReplicaDiedError) -> None:
        """Replica ``i`` is gone: each of its unanswered calls ends with ``err``."""
        calls, self._calls[i] = self._calls[i], deque()
        for c in calls:
            c.done, c.error = True, err
            if c.on_reply is not None:
                c.on_reply(None, err)
        self._replica_died(i, err)

    # -- requests -------------------------------------------------------------------------
    def prepare_request(self, request_id: str, prompt, params=None, priority: int = 0,
                        arrival_time: float | None = None) -> PreparedDPRequest:
        """Validate on a replica without queueing (so a batch is checked whole first).

        Raises:
            ValueError: as ``LLMEngine.add_request``.
            RuntimeError: every replica has died.
        """
        if request_id in self._owner:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        self._on_live_replica(lambda i: self._result(i, self._submit(i, "validate", request_id, prompt, params,
                                                                     priority)))
        return PreparedDPRequest(request_id, prompt, params, priority)

    def _on_live_replica(self, fn: Callable[[int], Any]) -> Any:
        """``fn(i)`` on the least-loaded live replica; if that one dies meanwhile, on the next."""
        while True:
            i = self.choose_replica()  # (raises once none is left)
            try:
                return fn(i)
            except ReplicaDiedError as e:
                self._replica_died(i, e)

    def enqueue(self, prepared: PreparedDPRequest) -> None:
        self.add_request(prepared.request_id, prepared.prompt, prepared.params, prepared.priority)

    def add_request(self, request_id: str, prompt, params=None, priority: int = 0,
                    arrival_time: float | None = None) -> None:
        """Route a request to the least-loaded live replica (raises ``ValueError`` like
        ``LLMEngine``; ``RuntimeError`` once every replica has died)."""
        if request_id in self._owner:
            raise ValueError(f"request_id: {request_id!r} is already in flight")

        def add(i: int) -> None:
            def routed() -> None:  # with the send: an abort finds it even if the answer is never read
                self._owner[request_id] = i
                self.in_flight[i] += 1
                self.num_routed[i] += 1

            def refused(_, err) -> None:
                if err is not None and self._owner.get(request_id) == i:
                    del self._owner[request_id]
                    self.in_flight[i] -= 1
                    self.num_routed[i] -= 1
            self._result(i, self._submit(i, "add", request_id, prompt, params, priority,
                                         on_reply=refused, on_sent=routed))
        self._on_live_replica(add)

    def abort_request(self, request_ids) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        by_replica: dict[int, list[str]] = {}
        for rid in ids:
            i = self._owner.get(rid)
            if i is not None and self.alive[i]:
                by_replica.setdefault(i, []).append(rid)
        for i, rids in by_replica.items():
            try:
                self._call(i, "abort", rids)
            except RuntimeError:
                pass

    def has_unfinished_requests(self) -> bool:
        return bool(self._owner) or bool(self._pending)

    def get_num_unfinished_requests(self) -> int:
        return len(self._owner)

    # -- step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Step every replica with requests, concurrently; outputs of all of them (and of
        steps an interrupt left unread)."""
        busy = sorted({i for i in self._owner.values() if self.alive[i]})
        calls = {}
        for i in busy:
            try:
                calls[i] = self._submit(i, "step", on_reply=functools.partial(self._stepped, i))
            except ReplicaDiedError:
                pass  # (retired by _submit)
        for i, call in calls.items():
            try:
                self._result(i, call)
            except Exception:  # noqa: BLE001 - (ReplicaDiedError too) retired by _stepped
                pass
        results, self._pending = self._pending, []
        return results

    def _stepped(self, i: int, reply, err: BaseException | None) -> None:
        """Apply replica ``i``'s answer to a step: its outputs, its finished requests."""
        if err is not None:
            self._replica_died(i, err)
            return
        outs, stats = reply
        self._stats[i] = stats
        self.kv_usage[i] = float(stats.get("kv_cache_usage", 0.0))
        for out in outs:
            if out.finished and self._owner.pop(out.request_id, None) is not None:
                self.in_flight[i] -= 1
        self._pending.extend(outs)

    def _replica_died(self, i: int, err: BaseException) -> None:
        if not self.alive[i]:
            return
        log.error("data-parallel replica %d died: %s", i, err)
        self.alive[i] = False
        self.replicas[i].kill()
        for rid in [r for r, o in self._owner.items() if o == i]:
            del self._owner[rid]
            self.in_flight[i] -= 1
            self._pending.append(RequestOutput(rid, None, [], None, [CompletionOutput(0, "", [], finish_reason="error")],
                                               True, error=f"data-parallel replica {i} died: {err}"))

    def stats(self) -> dict[str, float]:
        """Sums of the replicas' counters (``kv_cache_usage``: the mean), as of their last step."""
        out: dict[str, float] = {}
        for st in self._stats:
            for k, v in st.items():
                if isinstance(v, (int, float)):
                    out[k] = out.get(k, 0) + v
        n = len(self.replicas)
        if "kv_cache_usage" in out:
            out["kv_cache_usage"] /= n
        out["num_replicas_alive"] = sum(self.alive)
        return out

    def replica_stats(self) -> list[dict[str, float]]:
        """Each live replica's current ``stats()`` (a round trip to every one)."""
        return [self._call(i, "stats") for i in range(len(self.replicas)) if self.alive[i]]

    def start_profile(self, out_dir: str | None = None) -> None:
        """Profile every live replica (``LLMEngine.start_profile``): replica ``i`` writes its
        traces to ``<out_dir>/replica{i}/`` (on its own node with Ray).

        Raises:
            ValueError: no directory given or set, or it cannot be created here.
            RuntimeError: a replica could not start (those that did are stopped again).
        """
        from kvforge.engine.profiling import resolve_dir
        out_dir = resolve_dir(out_dir)
        started = []
        try:
            for i in range(len(self.replicas)):
                if self.alive[i]:
                    self._call(i, "start_profile", os.path.join(out_dir, f"replica{i}"))
                    started.append(i)
        except BaseException:
            for i in started:
                try:
                    self._call(i, "stop_profile")
                except Exception:  # noqa: BLE001 - the original error matters more
                    pass
            raise

    def stop_profile(self) -> list[str]:
        """Stop every live replica's profiling; returns all trace files written."""
        return [p for i in range(len(self.replicas)) if self.alive[i] for p in self._call(i, "stop_profile")]

    def shutdown(self) -> None:
        """Stop every replica (and their workers)."""
        for i, r in enumerate(self.replicas):
            try:
                if getattr(self, "alive", [True] * len(self.replicas))[i]:
                    r.result(r.submit("shutdown"), 30.0)
            except BaseException:  # noqa: BLE001
                pass
            r.kill()
        if hasattr(self, "alive"):
            self.alive = [False] * len(self.replicas)
