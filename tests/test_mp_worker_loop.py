"""The mp worker's serving loop (kvforge.distributed.mp._worker_main) with a fake Worker:
replies leave in call order from the reply thread, a sampled step's reply waits for its
tokens without stopping the loop from reading, and large messages both ways do not
deadlock the pipe (a reviewer's finding: the worker wrote a 600 KB reply while the driver
wrote a 600 KB step, each waiting for the other to read)."""
from __future__ import annotations

import multiprocessing as mp
import pickle
import threading
import time

import pytest
import torch

BIG = 600_000  # bytes: well past a socket buffer (~212 KB)


class _Pending:
    """Stands in for a PendingSamplerOutput whose host copy lands after ``delay`` seconds."""

    def __init__(self, payload: bytes, delay: float) -> None:
        self.token_ids = torch.zeros(1, dtype=torch.int64)
        self.payload, self.ready_at = payload, time.monotonic() + delay

    def result(self):
        time.sleep(max(0.0, self.ready_at - time.monotonic()))
        return self.payload


class _FakeWorker:
    def __init__(self, *a, **k) -> None:
        self.calls = 0

    def execute(self, msg):
        from kvforge.distributed.worker import SampledStep
        self.calls += 1
        return SampledStep(_Pending(b"x" * msg["reply_bytes"], msg["delay"]), None)

    def echo(self, value):
        return value

    def stamp(self):
        return time.monotonic()  # CLOCK_MONOTONIC: comparable across processes on one host

    def boom(self):
        raise KeyError("nope")

    def shutdown(self) -> None:
        pass


def _child(conn) -> None:
    import kvforge.distributed.mp as M
    import kvforge.distributed.worker as W
    W.Worker = _FakeWorker  # _worker_main imports Worker from this module
    M._worker_main(0, 1, {}, 0, 0, "", conn)


@pytest.fixture
def worker():
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=True)
    p = ctx.Process(target=_child, args=(child,), daemon=True)
    p.start()
    yield parent
    p.kill()
    p.join(5)


def _call(conn, method, *args) -> None:
    conn.send_bytes(pickle.dumps((method, args)))


def test_large_reply_and_large_step_do_not_deadlock(worker):
    _call(worker, "execute", {"reply_bytes": BIG, "delay": 0.0, "pad": b""})
    time.sleep(0.3)  # its reply is being written now, nobody reads it yet
    sent = threading.Event()
    threading.Thread(target=lambda: (_call(worker, "execute", {"reply_bytes": 10, "delay": 0.0,
                                                               "pad": b"y" * BIG}), sent.set()),
                     daemon=True).start()
    assert sent.wait(20), "the driver could not send the next step: both ends blocked writing"
    first, second = worker.recv(), worker.recv()
    assert first == ("ok", ("sampled", b"x" * BIG)) and second == ("ok", ("sampled", b"x" * 10))


def test_replies_keep_call_order_and_the_loop_reads_while_a_copy_is_pending(worker):
    _call(worker, "echo", 0)
    assert worker.recv() == ("ok", 0)  # the child is up: its start-up is not timed below
    t0 = time.monotonic()
    _call(worker, "execute", {"reply_bytes": 3, "delay": 1.0})  # tokens reach the host in 1 s
    _call(worker, "stamp")
    _call(worker, "boom")
    _call(worker, "execute", {"reply_bytes": 5, "delay": 0.0})
    got = [worker.recv() for _ in range(4)]
    assert got[0] == ("ok", ("sampled", b"xxx")) and time.monotonic() - t0 >= 0.9
    # the loop handled the next call while the first step's tokens were still on their way
    # (a loop that waited for them before reading on would have stamped after t0 + 1 s)
    assert got[1][0] == "ok" and got[1][1] - t0 < 0.5, got[1][1] - t0
    assert got[2][0] == "error" and got[2][1] == "KeyError"
    assert got[3] == ("ok", ("sampled", b"x" * 5))
    _call(worker, "shutdown")
    assert worker.recv() == ("ok", None)  # answered before the worker exits
