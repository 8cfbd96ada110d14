"""A worker's replies to the driver, sent in order by a background thread.

Two reasons not to send from the worker's main loop (``kvforge.distributed.mp``):

* A step sampled on the worker (:class:`~kvforge.distributed.worker.SampledStep`) can only
  be answered once its tokens reach the host, but the main loop should already be reading
  and launching the next step so the GPU never waits. The thread waits for the copy
  (``finalize``) and sends; the main loop goes straight back to its pipe. It also answers
  at once even if the main loop is blocked inside the next step (a collective whose peer
  failed), so the driver learns the real error instead of waiting for a timeout.
* Both ends write without reading while they write: a reply larger than the socket
  buffer (hundreds of KB: many rows with logprobs) sent while the driver writes a large
  step message to us would block both forever. A sender thread keeps the main loop reading.

Replies go out strictly in the order they were queued (one thread, one FIFO).
"""
from __future__ import annotations

import queue
import threading
import traceback
from typing import Any


def error_reply(e: BaseException) -> tuple:
    """The ``("error", type, message, traceback)`` reply the driver turns into a WorkerError."""
    return ("error", type(e).__name__, str(e), traceback.format_exc())


class ReplySender:
    """Send replies on ``conn`` from a daemon thread, in order.

    Args:
        conn: the worker's end of its duplex pipe to the driver.
    """

    def __init__(self, conn) -> None:
        self._conn = conn
        self._q: queue.Queue = queue.Queue()
        self.failed = False  # the pipe broke (the driver is gone)
        self._thread = threading.Thread(target=self._run, name="kvforge-reply-sender", daemon=True)
        self._thread.start()

    def put(self, reply: tuple) -> None:
        """Queue ``reply``; an ``("ok", obj)`` whose ``obj`` has ``finalize()`` is replaced by
        ``("ok", obj.finalize())`` in the thread (after waiting for the device)."""
        self._q.put(reply)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (up to ``timeout`` seconds), then stop the thread."""
        self._q.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            reply: Any = self._q.get()
            if reply is None:
                return
            if reply[0] == "ok" and hasattr(reply[1], "finalize"):
                try:
                    reply = ("ok", reply[1].finalize())
                except BaseException as e:  # noqa: BLE001 - the driver decides
                    reply = error_reply(e)
            try:
                self._conn.send(reply)
            except (EOFError, OSError, BrokenPipeError, ValueError):
                self.failed = True
                return
