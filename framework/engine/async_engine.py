"""AsyncLLMEngine: an :class:`LLMEngine` driven by a background thread, for asyncio servers.

Design: ``LLMEngine`` is not thread-safe, so exactly one thread — the engine thread —
touches it. Callers on any asyncio loop talk to it through a command queue
(``add`` / ``abort`` / ``stop``), which the thread drains between steps; while there is
no work it blocks on that queue, so an idle server uses no CPU. Outputs go back to each
caller's loop with one ``call_soon_threadsafe`` per loop per step. A model forward
releases the GIL, so HTTP parsing, tokenization and streaming on the loop run while the
engine computes, and the loop never waits for a step.

A request's outputs are cumulative by default (full text and token ids so far), so a slow
consumer simply skips to the newest one, and DELTA outputs are merged: a stream never grows an
unbounded queue (:mod:`kvforge.engine.request_stream`).

Lifecycle guarantees:
* a request id stays reserved from :meth:`AsyncLLMEngine.add_request` until the engine
  has emitted its final output (even after an abort), so a duplicate in-flight id is
  always rejected and a stale output can never reach a newer request with the same id;
* an abort (:meth:`RequestStream.abort`, also run when a consumer stops iterating early)
  is applied before the next step: the request's KV blocks return within one step;
* a failing forward pass ends that step's requests with ``finish_reason == "error"``
  (LLMEngine's rule); an exception escaping ``step()`` itself fails the in-flight
  requests with :class:`EngineError`, aborts them, and the thread keeps serving;
* :meth:`AsyncLLMEngine.shutdown` stops accepting, drains in-flight requests (or aborts
  them after a timeout), then stops the thread.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import defaultdict
from typing import Any, AsyncIterator

from kvforge.engine.llm_engine import LLMEngine, PromptType
from kvforge.engine.outputs import RequestOutput
from kvforge.engine.request_stream import EngineClosedError, EngineError, RequestStream, _deliver
from kvforge.engine.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["AsyncLLMEngine", "EngineClosedError", "EngineError", "RequestStream"]

log = logging.getLogger("kvforge.async_engine")


class AsyncLLMEngine:
    """Runs ``engine.step()`` on a dedicated thread while any request is in flight.

    Args:
        engine: the engine to drive; after :meth:`start` only the engine thread may touch it.
        metrics: optional :class:`kvforge.engine.metrics.EngineMetrics` to feed.
    """

    def __init__(self, engine: LLMEngine, metrics: Any = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self._cmds: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._lock = threading.Lock()
        self._inflight: set[str] = set()  # guarded by _lock
        self._accepting = True
        self._thread: threading.Thread | None = None
        self._stats: dict[str, float] = dict(engine.stats())
        self.last_step_time: float = 0.0
        self.num_steps = 0
        self.dead: BaseException | None = None

    @classmethod
    def from_kwargs(cls, model: str, config_file: str | None = None, **kwargs: Any) -> "AsyncLLMEngine":
        """Build the wrapped engine from flat options (see ``LLMEngine.from_kwargs``)."""
        return cls(LLMEngine.from_kwargs(model, config_file, **kwargs))

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvforge-engine", daemon=True)
            self._thread.start()

    @property
    def is_running(self) -> bool:
        """The engine thread is alive and healthy."""
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    def num_in_flight(self) -> int:
        """User requests accepted and not yet finished (including ones being aborted)."""
        with self._lock:
            return len(self._inflight)

    def stats(self) -> dict[str, float]:
        """The engine's ``stats()`` as of its latest step (safe from any thread)."""
        return self._stats

    async def shutdown(self, drain_timeout: float | None = 30.0) -> None:
        """Stop accepting requests, wait up to ``drain_timeout`` seconds (None: forever) for
        in-flight ones to finish, abort the rest, then stop the engine thread."""
        self._accepting = False
        deadline = None if drain_timeout is None else time.monotonic() + drain_timeout
        while self.num_in_flight() and self.is_running:
            if deadline is not None and time.monotonic() >= deadline:
                log.warning("drain timeout: aborting %d in-flight requests", self.num_in_flight())
                break
            await asyncio.sleep(0.02)
        if self._thread is not None:
            self._submit(("stop",))
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30.0)

    # -- requests -------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          priority: int = 0) -> RequestStream:
        """Queue a request; returns its stream once the engine has accepted it.

        Raises:
            ValueError: duplicate in-flight ``request_id`` or any validation error of
                ``LLMEngine.add_request`` (naming the field); nothing is queued then.
            EngineClosedError: the engine is shutting down.
            EngineError: the engine thread is dead.
        """
        if self.dead is not None:
            raise EngineError(f"engine is dead: {self.dead}")
        if not self._accepting:
            raise EngineClosedError("server is shutting down")
        grammars = getattr(self.engine, "_grammars", None)
        if grammars is not None and getattr(params, "structured_outputs", None) is not None:
            # compile here, off the engine thread (a large schema takes a while and every stream
            # would wait): the engine's own compile then hits XGrammar's cache
            await asyncio.get_running_loop().run_in_executor(None, grammars.compile, params.structured_outputs)
        with self._lock:
            if request_id in self._inflight:
                raise ValueError(f"request_id: {request_id!r} is already in flight")
            self._inflight.add(request_id)
        stream = RequestStream(request_id, self, asyncio.get_running_loop(),
                               delta=getattr(params, "output_kind", None) == RequestOutputKind.DELTA)
        self._submit(("add", stream, prompt, params, priority, time.monotonic()))
        try:
            while True:
                try:
                    await asyncio.wait_for(asyncio.shield(stream._accepted), timeout=1.0)
                    break
                except asyncio.TimeoutError:
                    if self._thread is not None and not self._thread.is_alive():
                        self._release(request_id)
                        raise EngineError("engine thread is not running") from None
        except asyncio.CancelledError:
            stream.abort()  # ordered after the add: the engine adds, then aborts
            raise
        return stream

    async def generate(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request (see :class:`RequestStream`); aborts the request
        if the caller stops iterating before the final output."""
        stream = await self.add_request(request_id, prompt, params, priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request by id (no-op if unknown or finished); thread-safe."""
        self._submit(("abort", request_id))

    def _submit(self, cmd: tuple) -> None:
        self._cmds.put(cmd)

    # -- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - a bug in the loop itself: fail loudly, never hang
            log.exception("engine thread died")
            self.dead = e
            self._fail_all(EngineError(f"engine thread died: {type(e).__name__}: {e}"), abort=True)
            while True:  # adds queued before `dead` was visible must not wait forever
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    break
                if cmd[0] == "add":
                    self._release(cmd[1].request_id)
                    self._call(cmd[1], cmd[1]._fail, EngineError("engine thread died"))

    def _loop(self) -> None:
        eng = self.engine
        running = True
        while running:
            busy = eng.has_unfinished_requests()
            cmds: list[tuple] = []
            try:
                cmds.append(self._cmds.get_nowait() if busy else self._cmds.get())
                while True:
                    cmds.append(self._cmds.get_nowait())
            except queue.Empty:
                pass
            for cmd in cmds:
                if cmd[0] == "add":
                    self._do_add(*cmd[1:])
                elif cmd[0] == "abort":
                    self._do_abort(cmd[1])
                elif cmd[0] == "stop":
                    running = False
            if not running:
                break
            if eng.has_unfinished_requests():
                t0 = time.monotonic()
                try:
                    outs = eng.step()
                except Exception as e:  # noqa: BLE001 - keep serving; fail what was in flight
                    log.exception("engine step raised; failing all in-flight requests")
                    self._fail_all(EngineError(f"engine failure: {type(e).__name__}: {e}"), abort=True)
                    continue
                self.last_step_time = time.monotonic() - t0
                self.num_steps += 1
                self._dispatch(outs)
            self._refresh_stats()
        self._fail_all(EngineClosedError("engine stopped"), abort=True)
        self._refresh_stats()

    def _refresh_stats(self) -> None:
        try:
            self._stats = dict(self.engine.stats())
        except Exception:  # noqa: BLE001 - stats are best effort
            pass

    def _do_add(self, stream: RequestStream, prompt: PromptType, params: SamplingParams, priority: int,
                arrival: float) -> None:
        rid = stream.request_id
        try:
            if rid in self._streams:
                raise ValueError(f"request_id: {rid!r} is already in flight")
            self.engine.add_request(rid, prompt, params, priority=priority, arrival_time=arrival)
        except Exception as e:  # noqa: BLE001 - validation errors go back to the caller
            self._release(rid)
            self._call(stream, stream._fail, e)
            return
        self._streams[rid] = stream
        if self.metrics is not None:
            parent = getattr(self.engine, "outputs", None) and self.engine.outputs.parents.get(rid)
            if parent is not None:
                self.metrics.on_request_added(len(parent.prompt_token_ids))
        self._call(stream, stream._accept)

    def _do_abort(self, rid: str) -> None:
        stream = self._streams.get(rid)
        if stream is None:
            return
        try:
            self.engine.abort_request(rid)
        except Exception as e:  # noqa: BLE001
            log.exception("abort of %s failed", rid)
            self._streams.pop(rid, None)
            self._release(rid)
            self._call(stream, stream._fail, EngineError(f"abort failed: {e}"))
        # the final "abort" output arrives from the next step() and releases the id

    def _dispatch(self, outs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = defaultdict(list)
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if self.metrics is not None:
                counts = stream._tokens_per_completion  # (a DELTA output carries only its new ids)
                for c in out.outputs:
                    counts[c.index] = counts.get(c.index, 0) + len(c.token_ids) if stream._delta else len(c.token_ids)
                ntok = sum(counts.values())
                itl = None
                if ntok > stream._num_tokens_seen:
                    now = time.monotonic()
                    if stream._last_token_time is not None:
                        itl = now - stream._last_token_time
                    stream._last_token_time = now
                self.metrics.on_tokens(ntok - stream._num_tokens_seen, itl)
                stream._num_tokens_seen = ntok
            if out.finished:
                del self._streams[out.request_id]
                self._release(out.request_id)
                if self.metrics is not None:
                    self.metrics.on_request_finished(out, max(stream._tokens_per_completion.values(), default=0))
            by_loop[stream._loop].append((stream, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the consumer's loop is closed: nobody is listening
                pass

    def _fail_all(self, exc: BaseException, abort: bool) -> None:
        streams = list(self._streams.values())
        self._streams.clear()
        if abort and streams:
            try:
                self.engine.abort_request([s.request_id for s in streams])
                for _ in range(1000):  # emit the abort outputs; nobody listens any more
                    if not self.engine.has_unfinished_requests():
                        break
                    self.engine.step()
            except Exception as e:  # noqa: BLE001 - the engine cannot even abort: give up
                log.exception("engine could not abort after a failure; marking it dead")
                self.dead = e
        for s in streams:
            self._release(s.request_id)
            self._call(s, s._fail, exc)

    def _release(self, rid: str) -> None:
        with self._lock:
            self._inflight.discard(rid)

    @staticmethod
    def _call(stream: RequestStream, fn, *args) -> None:
        try:
            stream._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass
