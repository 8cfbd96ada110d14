"""Multiprocessing executor: one worker process per rank, on this node.

Workers are started with ``torch.multiprocessing`` (:func:`mp_context`: ``spawn`` for GPU
workers; for CPU workers ``forkserver`` — a spawned server that imported torch, transformers
and kvforge once forks each worker, so later engines start theirs without re-importing;
``KVFORGE_WORKER_MULTIPROC_METHOD`` overrides). Each worker talks to the driver over its
own duplex pipe: the driver writes a pickled ``(method, args)``, the worker answers
``("ok", result)`` or ``("error", ...)``.
The ranks join one ``torch.distributed`` process group (NCCL on GPU, gloo on CPU) at a
``tcp://127.0.0.1:<free port>`` rendezvous; rank r uses ``cuda:r``.

Liveness: while it waits, the driver watches every worker's pipe *and* process sentinel
(:func:`multiprocessing.connection.wait`), so a worker that dies is noticed at once, not
when a timeout expires; a worker whose driver is gone reads EOF and exits. On GPU the
output rank shares its logits buffer with the driver once (CUDA IPC), so a step moves no
logits through the pipe.

Interrupts: each message is written and read whole, with SIGINT held back meanwhile
(:mod:`kvforge.distributed.interrupts`), and the driver counts the replies each rank still
owes, so after a Ctrl-C :meth:`MultiprocExecutor._drain` can read exactly what is left.
"""
from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import socket
import sys
import time
import weakref
from multiprocessing.connection import wait as mp_wait
from typing import Any

import torch

from kvforge.distributed.executor_base import DistributedExecutor, WorkerDiedError, WorkerError, WorkerTimeoutError
from kvforge.distributed.interrupts import defer_sigint

log = logging.getLogger("kvforge.distributed")

START_METHOD_ENV = "KVFORGE_WORKER_MULTIPROC_METHOD"


def mp_context(cuda: bool = False):
    """The ``torch.multiprocessing`` context workers start from: ``$KVFORGE_WORKER_MULTIPROC_METHOD``,
    else ``spawn`` for GPU workers and, for CPU workers on Linux, ``forkserver`` (a server
    process, started like ``spawn``, imports torch/transformers/kvforge once and forks each
    worker from that clean state: a second engine's workers start in well under a second).
    GPU workers default to ``spawn`` because a plugin that touched CUDA at import time would
    leave the forkserver unable to fork CUDA-capable children. ``fork`` is refused: a forked
    CUDA or gloo state is unsafe."""
    default = "forkserver" if sys.platform.startswith("linux") and not cuda else "spawn"
    method = os.environ.get(START_METHOD_ENV, default)
    if method not in ("spawn", "forkserver"):
        raise ValueError(f"{START_METHOD_ENV}={method!r}: use 'spawn' or 'forkserver'")
    ctx = torch.multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["kvforge.distributed.worker", "kvforge.engine.llm_engine", *_plugin_modules()])
    return ctx


def _plugin_modules() -> list[str]:
    """Modules of the kvforge plugins the driver loads (imported by the forkserver up front):
    the entry points ``KVFORGE_PLUGINS`` / ``KVFORGE_DISABLE_PLUGINS`` leave, never the others
    (a disabled plugin that fails at import would kill the forkserver)."""
    from kvforge.plugin_manager import enabled_entry_points
    try:
        return sorted({ep.value.split(":")[0] for ep in enabled_entry_points()})
    except Exception:  # noqa: BLE001 - preloading is only an optimisation
        return []


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _worker_main(rank: int, world_size: int, config: dict, max_model_len: int, device_index: int,
                 init_method: str, conn) -> None:
    """Entry point of a worker process: serve the driver's calls until shutdown or EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's business; it stops us
    from kvforge.distributed.worker import Worker
    worker = Worker(rank, world_size, config, max_model_len, device_index, init_method)

    def receive_tokens():
        """The ("tokens", int64 array) message a step with placeholders waits for."""
        method, args = pickle.loads(conn.recv_bytes())
        if method != "tokens":
            raise RuntimeError(f"expected the previous step's tokens, got a {method!r} call")
        return args[0]
    worker.receive_tokens = receive_tokens
    from kvforge.distributed.reply_sender import ReplySender, error_reply
    sender = ReplySender(conn)
    while not sender.failed:
        try:
            method, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the driver is gone
            break
        try:
            reply = ("ok", getattr(worker, method)(*args))
        except BaseException as e:  # noqa: BLE001 - report everything; the driver decides
            reply = error_reply(e)
        sender.put(reply)  # a SampledStep is answered once its tokens reach the host
        if method == "shutdown":
            break
    sender.close()
    try:
        worker.shutdown()
    except Exception:  # noqa: BLE001
        pass
    os._exit(0)  # skip interpreter teardown (atexit hooks of torch/gloo can block on dead peers)


@contextlib.contextmanager
def _without_main_reimport():
    """Start children without re-running the user's ``__main__`` script in them.

    ``spawn``/``forkserver`` children re-import the parent's main module by path (so a
    script that builds an engine at top level, without an ``if __name__ == "__main__"``
    guard, would recurse). Workers need nothing from it, so the path is hidden while the
    children are started."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None) if getattr(main, "__spec__", None) is None else None
    if path is None:
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def _kill(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


class MultiprocExecutor(DistributedExecutor):
    """``world_size`` worker processes on this node (see module docstring)."""

    def __init__(self, config, max_model_len: int, device: torch.device) -> None:
        super().__init__(config, max_model_len, device)
        if device.type == "cuda" and torch.cuda.device_count() < self.world_size:
            raise ValueError(f"parallel: tensor_parallel_size x pipeline_parallel_size = {self.world_size} needs "
                             f"{self.world_size} GPUs on this node; it has {torch.cuda.device_count()} "
                             "(use distributed_executor_backend='ray' for several nodes)")
        ctx = mp_context(cuda=device.type == "cuda")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        cfg = config.to_transfer()
        self.procs, self.conns = [], []
        self._owed = [0] * self.world_size  # replies each rank still owes (messages sent, answers not read)
        with _without_main_reimport():
            for rank in range(self.world_size):
                parent, child = ctx.Pipe(duplex=True)
                p = ctx.Process(target=_worker_main, name=f"kvforge-worker-{rank}", daemon=True,
                                args=(rank, self.world_size, cfg, max_model_len, rank, init_method, child))
                p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
        self._finalizer = weakref.finalize(self, _kill, self.procs)
        log.info("started %d worker processes (%s): pids %s", self.world_size, ctx.get_start_method(), [p.pid for p in self.procs])

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _share_output(self) -> bool:
        return self.device.type == "cuda"

    def _send_tokens(self, tokens) -> None:
        self._send_all("tokens", (tokens,))

    def _send_all(self, method: str, args: tuple) -> None:
        payload = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        with defer_sigint():  # every rank gets the message, or the stream is known to be torn
            for rank, conn in enumerate(self.conns):
                try:
                    conn.send_bytes(payload)
                except (OSError, BrokenPipeError):
                    raise self._died(rank) from None
                except BaseException as e:
                    self._torn(f"writing {method!r} to", rank, e)
                    raise
                if method != "tokens":  # the one message without an answer
                    self._owed[rank] += 1

    def _drain(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while any(self._owed):
            self._read([r for r, n in enumerate(self._owed) if n], "execute", max(deadline - time.monotonic(), 0.0))

    def _torn(self, what: str, rank: int, exc: BaseException) -> None:
        self._mark_dead(WorkerError(
            f"{type(exc).__name__} while {what} worker rank {rank}: the pipe holds part of a message, so the "
            "driver and the workers cannot be brought back in step"))

    def _recv_all(self, handle: None, method: str, timeout: float) -> list[Any]:
        return self._read(range(self.world_size), method, timeout)

    def _read(self, ranks, method: str, timeout: float) -> list[Any]:
        """The next reply of each of ``ranks`` (by rank; None for the others)."""
        results: list[Any] = [None] * self.world_size
        pending = {r: self.conns[r] for r in ranks}
        by_sentinel = {p.sentinel: r for r, p in enumerate(self.procs)}
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerTimeoutError(f"workers {sorted(pending)} did not finish {method!r} within {timeout:.0f} s "
                                         "(parallel.worker_timeout_s)")
            ready = mp_wait(list(pending.values()) + list(by_sentinel), timeout=min(left, 1.0))
            for obj in ready:
                if obj in by_sentinel:
                    if method == "shutdown" and by_sentinel[obj] not in pending:
                        continue
                    raise self._died(by_sentinel[obj])
            replies = []
            with defer_sigint():  # the ready replies are read whole and counted
                for obj in ready:
                    if obj in by_sentinel:
                        continue
                    rank = self.conns.index(obj)
                    try:
                        replies.append((rank, obj.recv()))
                    except (EOFError, OSError):
                        raise self._died(rank) from None
                    except BaseException as e:
                        self._torn("reading a reply from", rank, e)
                        raise
                    self._owed[rank] -= 1
            for rank, reply in replies:  # (outside: an error here must not be lost to a held Ctrl-C)
                if reply[0] == "error":
                    _, etype, emsg, tb = reply
                    dead = self._dead_peer(by_sentinel) if etype != "ValueError" else None
                    if dead is not None:  # a collective failed because a peer died: report the death
                        raise self._died(dead)
                    if method == "load_model" and etype == "ValueError":  # bad input (a checkpoint
                        # tensor, a config field): its message says it all, as on one rank
                        log.debug("worker rank %d failed in %s:\n%s", rank, method, tb)
                        raise ValueError(emsg)
                    log.error("worker rank %d failed in %s:\n%s", rank, method, tb)
                    raise WorkerError(f"worker rank {rank} failed in {method}: {etype}: {emsg}")
                results[rank] = reply[1]
                del pending[rank]
        return results

    @staticmethod
    def _dead_peer(by_sentinel: dict, wait: float = 1.0) -> int | None:
        """The rank of a worker process that has exited, waiting up to ``wait`` seconds: a
        surviving rank's collective fails (gloo: "connection reset") as soon as its peer's
        sockets close, which can be before the dead process's sentinel is ready."""
        ready = mp_wait(list(by_sentinel), timeout=wait)
        return by_sentinel[ready[0]] if ready else None

    def _died(self, rank: int) -> WorkerDiedError:
        p = self.procs[rank]
        p.join(timeout=0.5)
        code = p.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return WorkerDiedError(f"worker rank {rank} (pid {p.pid}) died ({how})")

    def _kill_workers(self) -> None:
        _kill(self.procs)
        for c in self.conns:
            c.close()
