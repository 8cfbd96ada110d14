"""Replica transports for data parallelism: a replica is a whole LLMEngine in its own
process, reached either as a Ray actor or as a local process over a pipe. Used by
:class:`kvforge.distributed.data_parallel.DataParallelEngine`.

A transport answers calls in the order they were submitted: ``submit`` sends one,
``wait`` blocks (interruptibly) until the oldest unread answer is ready and ``take`` reads
it, so the front end can read an answer and account for it with SIGINT held back
(:mod:`kvforge.distributed.interrupts`) and never loses one to a Ctrl-C."""
from __future__ import annotations

import logging
import os
import pickle
import signal
import time
import weakref
from multiprocessing.connection import wait as mp_wait

from kvforge.distributed.interrupts import defer_sigint
from kvforge.distributed.reply_sender import error_reply
from kvforge.engine.outputs import RequestOutput

log = logging.getLogger("kvforge.distributed")


class ReplicaServer:
    """One replica's engine, wherever it runs (Ray actor body or process loop)."""

    def __init__(self, config: dict, index: int) -> None:
        from kvforge.config import EngineConfig
        from kvforge.engine.llm_engine import LLMEngine
        cfg = EngineConfig.model_validate(config)
        cfg.parallel.data_parallel_size = 1
        self.index = index
        self.engine = LLMEngine(cfg)

    def info(self) -> dict:
        e = self.engine
        node = None
        try:
            import ray
            if ray.is_initialized():
                node = ray.get_runtime_context().get_node_id()
        except ImportError:
            pass
        return {"max_model_len": e.max_model_len, "vocab_size": e.vocab_size, "pid": os.getpid(), "node": node,
                "max_num_seqs": e.config.scheduler.max_num_seqs, "choices": e.parts.choices}

    def validate(self, request_id: str, prompt, params, priority: int) -> None:
        self.engine.prepare_request(request_id, prompt, params, priority)

    def add(self, request_id: str, prompt, params, priority: int) -> None:
        self.engine.add_request(request_id, prompt, params, priority)

    def abort(self, request_ids: list[str]) -> None:
        self.engine.abort_request(request_ids)

    def step(self) -> tuple[list[RequestOutput], dict[str, float]]:
        e = self.engine
        outs = e.step() if e.has_unfinished_requests() else []
        return outs, self.stats()

    def stats(self) -> dict[str, float]:
        st = dict(self.engine.stats())
        a = self.engine.allocator
        st.setdefault("kv_cache_usage", 1.0 - a.num_free_blocks / a.num_blocks)
        st["num_unfinished_requests"] = self.engine.get_num_unfinished_requests()
        st["num_free_blocks"], st["num_blocks"] = a.num_free_blocks, a.num_blocks
        return st

    def start_profile(self, out_dir: str) -> None:
        self.engine.start_profile(out_dir)

    def stop_profile(self) -> list[str]:
        return self.engine.stop_profile()

    def shutdown(self) -> None:
        ex = getattr(self.engine, "executor", None)
        if ex is not None:
            ex.shutdown()


# -- transports -----------------------------------------------------------------------------

class _RayReplica:
    def __init__(self, config, index: int) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from kvforge.distributed.ray_executor import init_ray, worker_runtime_env
        init_ray(config.parallel.ray_address)
        self._ray = ray
        gpu = config.model.device == "cuda" or (config.model.device == "auto" and ray.cluster_resources().get("GPU"))
        world = config.parallel.world_size
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        self.pg = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
        # The replica's engine sits in bundle 0: alone (world 1) it is the worker and takes the
        # bundle's resources; with workers of its own it is only the driver.
        own = world == 1
        opts = dict(num_cpus=1 if own and not gpu else 0, num_gpus=1 if own and gpu else 0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True),
                    runtime_env=worker_runtime_env())
        self.actor = ray.remote(ReplicaServer).options(**opts).remote(config.to_transfer(), index)

    def submit(self, method: str, *args):
        return getattr(self.actor, method).remote(*args)

    def wait(self, handle, timeout: float) -> None:
        ready, _ = self._ray.wait([handle], num_returns=1, timeout=timeout)
        if not ready:
            raise ReplicaDiedError(f"replica did not answer within {timeout:.0f} s")

    def take(self, handle):
        return self.result(handle, 0)

    def result(self, handle, timeout: float):
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
        try:
            return self._ray.get(handle, timeout=timeout)
        except RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, ValueError):
                raise ValueError(str(cause)) from None
            raise
        except RayActorError as e:
            raise ReplicaDiedError(f"replica actor died: {e}") from None
        except GetTimeoutError:
            raise ReplicaDiedError(f"replica did not answer within {timeout:.0f} s") from None

    def wait_any(self, handles: list, timeout: float) -> list:
        ready, _ = self._ray.wait(handles, num_returns=len(handles), timeout=timeout)
        return ready

    def kill(self) -> None:
        try:
            self._ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001
            pass
        try:
            self._ray.util.remove_placement_group(self.pg)
        except Exception:  # noqa: BLE001
            pass


def _replica_main(config: dict, index: int, visible_gpus: str | None, conn) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if visible_gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_gpus
    try:
        server = ReplicaServer(config, index)
        conn.send(("ok", None))
    except BaseException as e:  # noqa: BLE001
        conn.send(error_reply(e))
        os._exit(0)
    while True:
        try:
            method, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break
        try:
            reply = ("ok", getattr(server, method)(*args))
        except BaseException as e:  # noqa: BLE001
            reply = error_reply(e)
        try:
            conn.send(reply)
        except (OSError, BrokenPipeError):
            break
        if method == "shutdown":
            break
    try:
        server.shutdown()
    except Exception:  # noqa: BLE001
        pass
    os._exit(0)


def _stop_process(conn, proc) -> None:
    try:
        conn.close()
    except OSError:
        pass
    proc.join(timeout=10)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=5)


class _ProcReplica:
    def __init__(self, config, index: int) -> None:
        import torch

        from kvforge.distributed.mp import _without_main_reimport, mp_context
        world = config.parallel.world_size
        visible = None
        gpu = config.model.device != "cpu" and torch.cuda.is_available()
        ctx = mp_context(cuda=gpu)
        if gpu:
            n = torch.cuda.device_count()
            if n < world * config.parallel.data_parallel_size:
                raise ValueError(f"parallel: {config.parallel.data_parallel_size} replicas x {world} ranks need "
                                 f"{world * config.parallel.data_parallel_size} GPUs; this node has {n}")
            visible = ",".join(str(g) for g in range(index * world, (index + 1) * world))
        self.conn, child = ctx.Pipe(duplex=True)
        with _without_main_reimport():
            self.proc = ctx.Process(target=_replica_main, args=(config.to_transfer(), index, visible, child),
                                    name=f"kvforge-replica-{index}", daemon=False)
            self.proc.start()
        child.close()
        self._started = False
        self._torn: str | None = None  # why the pipe can no longer be trusted (an interrupted write or read)
        # At interpreter exit (before multiprocessing joins its non-daemonic children): close the
        # pipe so the replica reads EOF, stops its own workers and exits.
        self._finalizer = weakref.finalize(self, _stop_process, self.conn, self.proc)

    def submit(self, method: str, *args):
        if not self._started:  # the first reply is the build's
            self._started = True
            self.result(None, float("inf"))
        self._check_torn()
        payload = pickle.dumps((method, args))
        with defer_sigint():
            try:
                self.conn.send_bytes(payload)
            except (OSError, BrokenPipeError):
                raise ReplicaDiedError(f"replica process {self.proc.pid} died") from None
            except BaseException as e:
                self._torn = f"{type(e).__name__} while writing {method!r} to the replica"
                raise
        return method

    def _check_torn(self) -> None:
        if self._torn is not None:
            raise ReplicaDiedError(f"{self._torn}: its pipe holds part of a message, so it cannot be used again")

    def wait(self, handle, timeout: float) -> None:
        """Until the oldest unread reply is ready. Raises ReplicaDiedError (died, timeout)."""
        self._check_torn()
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ReplicaDiedError(f"replica did not answer within {timeout:.0f} s")
            ready = mp_wait([self.conn, self.proc.sentinel], timeout=min(left, 1.0))
            if self.conn in ready:
                return
            if self.proc.sentinel in ready:
                raise ReplicaDiedError(f"replica process {self.proc.pid} died (exit code {self.proc.exitcode})")

    def take(self, handle):
        """Read the ready reply: its value, or raise the replica's error (ValueError
        as itself, others as RuntimeError)."""
        self._check_torn()
        try:
            reply = self.conn.recv()
        except (EOFError, OSError):
            raise ReplicaDiedError(f"replica process {self.proc.pid} died") from None
        except BaseException as e:
            self._torn = f"{type(e).__name__} while reading a reply from the replica"
            raise
        if reply[0] == "error":
            _, etype, emsg, tb = reply
            if etype == "ValueError":
                raise ValueError(emsg)
            raise RuntimeError(f"replica failed: {etype}: {emsg}\n{tb}")
        return reply[1]

    def result(self, handle, timeout: float):
        self.wait(handle, timeout)
        with defer_sigint():
            return self.take(handle)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self._finalizer()


class ReplicaDiedError(RuntimeError):
    """A data-parallel replica's process or actor is gone."""
