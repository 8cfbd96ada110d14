"""Ctrl-C and the driver's pipes: a KeyboardInterrupt lands between messages, never inside one.

The driver talks to its workers (and to data-parallel replicas) over byte streams. Python
raises KeyboardInterrupt from the SIGINT handler at whatever bytecode the main thread runs,
so a Ctrl-C during ``LLM.generate`` could stop the driver half way through writing or
reading a message: the stream would then hold half a message and the ranks could never be
brought back in step. :class:`defer_sigint` holds SIGINT back while the driver writes or
reads one message *and* updates its count of replies owed, and lets it through right after.
The waits between messages stay interruptible (that is where a Ctrl-C normally lands);
what they leave owed is read and dropped before the next call
(``DistributedExecutor._resync``, ``DataParallelEngine._drain``).

A second Ctrl-C while one is held goes through at once (a write to a hung peer must not
trap the user); the message is then torn and the executor says so on the next call.
"""
from __future__ import annotations

import signal
import threading


_depth = 0  # open defer_sigint blocks in the main thread (only the outermost swaps the handler)


class defer_sigint:
    """``with defer_sigint(): ...``: a SIGINT arriving inside the block raises its
    KeyboardInterrupt (or runs the program's own handler) when the block exits.

    Only in the main thread (Python runs signal handlers there) and only when SIGINT has a
    Python handler (``SIG_IGN`` / ``SIG_DFL`` are left alone); nested blocks cost nothing
    and defer to the outermost one. ``_thread.interrupt_main()`` is deferred the same way.
    The outermost block swaps the handler twice (a few microseconds).
    """

    __slots__ = ("_old", "_got", "_main")

    def __enter__(self) -> "defer_sigint":
        global _depth
        self._old = self._got = None
        self._main = threading.current_thread() is threading.main_thread()
        if not self._main:
            return self
        _depth += 1
        if _depth == 1:
            old = signal.getsignal(signal.SIGINT)
            if callable(old):
                signal.signal(signal.SIGINT, self._hold)
                self._old = old
        return self

    def _hold(self, signum, frame) -> None:
        if self._got is None:
            self._got = (signum, frame)
            return
        old, self._old = self._old, None  # a second one: let it through now
        signal.signal(signal.SIGINT, old)
        old(signum, frame)

    def __exit__(self, *exc) -> bool:
        global _depth
        if self._main:
            _depth -= 1
        old, self._old = self._old, None
        if old is not None:
            signal.signal(signal.SIGINT, old)
            if self._got is not None:
                old(*self._got)
        return False


def is_interrupt(exc: BaseException) -> bool:
    """Whether ``exc`` stopped the caller rather than reporting a failure
    (KeyboardInterrupt, SystemExit, ...: anything not an ``Exception``)."""
    return not isinstance(exc, Exception)
