"""The caller's side of one request of :class:`~kvforge.engine.async_engine.AsyncLLMEngine`:
an async iterator the engine thread feeds through the caller's event loop, and the errors it
raises.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from kvforge.engine.outputs import RequestOutput

if TYPE_CHECKING:  # pragma: no cover
    from kvforge.engine.async_engine import AsyncLLMEngine


class EngineError(RuntimeError):
    """The engine failed outside a single request (its requests were ended)."""


class EngineClosedError(RuntimeError):
    """The engine is shutting down and accepts no new requests."""


class RequestStream:
    """Async iterator over one request's :class:`RequestOutput` objects, newest first-come.

    Items are as the request's ``output_kind`` says (cumulative by default). A consumer slower
    than the engine gets fewer items: cumulative ones skip to the newest, DELTA ones are
    merged (:meth:`RequestOutput.add`), so no text is lost. The last item has
    ``finished == True``. Iterating raises :class:`EngineError` if the engine failed under the
    request. Not thread-safe: use it on the loop that created it.
    """

    def __init__(self, request_id: str, owner: "AsyncLLMEngine", loop: asyncio.AbstractEventLoop,
                 delta: bool = False) -> None:
        self.request_id = request_id
        self._delta = delta
        self._owner = owner
        self._loop = loop
        self._event = asyncio.Event()
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._finished = False
        self._aborted = False
        self._accepted: asyncio.Future = loop.create_future()
        # engine-thread side bookkeeping (never touched by the loop)
        self._num_tokens_seen = 0
        self._tokens_per_completion: dict[int, int] = {}
        self._last_token_time: float | None = None  # (monotonic) of its latest new tokens: ITL

    # -- called on the loop (scheduled by the engine thread) --------------------------------
    def _put(self, out: RequestOutput) -> None:
        if self._delta and self._latest is not None:
            self._latest.add(out, aggregate=True)
        else:
            self._latest = out
        self._event.set()

    def _fail(self, exc: BaseException) -> None:
        if not self._accepted.done():
            self._accepted.set_exception(exc)
            self._accepted.exception()  # mark retrieved: a cancelled waiter must not log it
        self._error = exc
        self._event.set()

    def _accept(self) -> None:
        if not self._accepted.done():
            self._accepted.set_result(None)

    # -- consumer API ---------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        """True once the final output was returned (or the stream failed)."""
        return self._finished

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._latest is not None:
                out, self._latest = self._latest, None
                if out.finished:
                    self._finished = True
                return out
            if self._error is not None:
                self._finished = True
                raise self._error
            if self._finished:
                raise StopAsyncIteration
            self._event.clear()
            await self._event.wait()

    def abort(self) -> None:
        """Abort the request unless its final output was already returned. Idempotent."""
        if not self._finished and not self._aborted:
            self._aborted = True
            self._owner._submit(("abort", self.request_id))


def _deliver(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, out in items:
        stream._put(out)
