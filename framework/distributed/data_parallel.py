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
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import time
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing.connection import wait as mp_wait
from typing import Any

from kvforge.engine.outputs import CompletionOutput, RequestOutput

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
        self.actor = ray.remote(ReplicaServer).options(**opts).remote(config.model_dump(), index)

    def submit(self, method: str, *args):
        return getattr(self.actor, method).remote(*args)

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
        conn.send(("error", type(e).__name__, str(e), traceback.format_exc()))
        os._exit(0)
    while True:
        try:
            method, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break
        try:
            reply = ("ok", getattr(server, method)(*args))
        except BaseException as e:  # noqa: BLE001
            reply = ("error", type(e).__name__, str(e), traceback.format_exc())
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
            self.proc = ctx.Process(target=_replica_main, args=(config.model_dump(), index, visible, child),
                                    name=f"kvforge-replica-{index}", daemon=False)
            self.proc.start()
        child.close()
        self._started = False
        # At interpreter exit (before multiprocessing joins its non-daemonic children): close the
        # pipe so the replica reads EOF, stops its own workers and exits.
        self._finalizer = weakref.finalize(self, _stop_process, self.conn, self.proc)

    def submit(self, method: str, *args):
        if not self._started:  # the first reply is the build's
            self._started = True
            self._take(float("inf"))
        try:
            self.conn.send_bytes(pickle.dumps((method, args)))
        except (OSError, BrokenPipeError):
            raise ReplicaDiedError(f"replica process {self.proc.pid} died") from None
        return method

    def _take(self, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ReplicaDiedError(f"replica did not answer within {timeout:.0f} s")
            ready = mp_wait([self.conn, self.proc.sentinel], timeout=min(left, 1.0))
            if self.conn in ready:
                try:
                    reply = self.conn.recv()
                except (EOFError, OSError):
                    raise ReplicaDiedError(f"replica process {self.proc.pid} died") from None
                break
            if self.proc.sentinel in ready:
                raise ReplicaDiedError(f"replica process {self.proc.pid} died (exit code {self.proc.exitcode})")
        if reply[0] == "error":
            _, etype, emsg, tb = reply
            if etype == "ValueError":
                raise ValueError(emsg)
            raise RuntimeError(f"replica failed: {etype}: {emsg}\n{tb}")
        return reply[1]

    def result(self, handle, timeout: float):
        return self._take(timeout)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self._finalizer()


class ReplicaDiedError(RuntimeError):
    """A data-parallel replica's process or actor is gone."""


@dataclass
class PreparedDPRequest:
    request_id: str
    prompt: Any
    params: Any
    priority: int


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
            return self.replicas[i].result(self.replicas[i].submit(method, *args), self.timeout_s)
        except ReplicaDiedError as e:
            self._replica_died(i, e)
            raise RuntimeError(f"data-parallel replica {i} died: {e}") from None

    # -- requests -------------------------------------------------------------------------
    def prepare_request(self, request_id: str, prompt, params=None, priority: int = 0,
                        arrival_time: float | None = None) -> PreparedDPRequest:
        """Validate on a replica without queueing (so a batch is checked whole first).

        Raises:
            ValueError: as ``LLMEngine.add_request``.
        """
        if request_id in self._owner:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        self._call(self.choose_replica(), "validate", request_id, prompt, params, priority)
        return PreparedDPRequest(request_id, prompt, params, priority)

    def enqueue(self, prepared: PreparedDPRequest) -> None:
        self.add_request(prepared.request_id, prepared.prompt, prepared.params, prepared.priority)

    def add_request(self, request_id: str, prompt, params=None, priority: int = 0,
                    arrival_time: float | None = None) -> None:
        """Route a request to the least-loaded replica (raises ``ValueError`` like ``LLMEngine``)."""
        if request_id in self._owner:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        i = self.choose_replica()
        self._call(i, "add", request_id, prompt, params, priority)
        self._owner[request_id] = i
        self.in_flight[i] += 1
        self.num_routed[i] += 1

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
        """Step every replica with requests, concurrently; outputs of all of them."""
        results, self._pending = self._pending, []
        busy = sorted({i for i in self._owner.values() if self.alive[i]})
        handles = {}
        for i in busy:
            try:
                handles[i] = self.replicas[i].submit("step")
            except ReplicaDiedError as e:
                self._replica_died(i, e)
        for i, h in handles.items():
            try:
                outs, stats = self.replicas[i].result(h, self.timeout_s)
            except (ReplicaDiedError, RuntimeError) as e:
                self._replica_died(i, e)
                continue
            self._stats[i] = stats
            self.kv_usage[i] = float(stats.get("kv_cache_usage", 0.0))
            for out in outs:
                if out.finished and self._owner.pop(out.request_id, None) is not None:
                    self.in_flight[i] -= 1
            results.extend(outs)
        results.extend(self._pending)
        self._pending = []
        return results

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
