"""Ray executor: one Ray actor per rank, in one placement group per replica (any number of nodes).

``distributed_executor_backend: ray`` (CLI ``--distributed-executor-backend ray``). The
driver joins the cluster (``parallel.ray_address``, else ``RAY_ADDRESS``, else a new local
one), reserves a placement group of ``world_size`` bundles (``{"GPU": 1}`` each on GPU,
``{"CPU": 1}`` on CPU; strategy ``PACK``: one node if it fits, spread otherwise) — or uses
the placement group it is already running in, when a data-parallel replica actor created
it — and starts one :class:`RayWorker` actor per bundle. Rank 0's node hosts the
``torch.distributed`` rendezvous; the ranks then talk over NCCL/gloo directly, Ray only
carries the per-step messages and the logits back.

Liveness: the driver waits with :func:`ray.wait` in short slices; a dead actor's call
fails at once with ``RayActorError``, a hung one hits ``parallel.worker_timeout_s``.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from kvforge.distributed.executor_base import DistributedExecutor, WorkerDiedError, WorkerError, WorkerTimeoutError

log = logging.getLogger("kvforge.distributed")

#: Environment variables a worker inherits from the driver (Ray workers start from the raylet's env).
FORWARDED_ENV = ("OMP_NUM_THREADS", "KVFORGE_PLUGINS", "KVFORGE_DISABLE_PLUGINS", "KVFORGE_DISABLE_FUSED_KERNELS",
                 "NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


def init_ray(address: str | None) -> None:
    """Connect to (or start) a Ray cluster once per process."""
    import ray
    if ray.is_initialized():
        return
    if address is None and not os.environ.get("RAY_ADDRESS"):
        ray.init(include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=address, log_to_driver=False)


def worker_runtime_env() -> dict:
    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    return {"env_vars": env} if env else {}


class RayWorker:
    """Actor body: hosts one :class:`~kvforge.distributed.worker.Worker`."""

    def __init__(self, rank: int, world_size: int, config: dict, max_model_len: int) -> None:
        self.rank, self.world_size, self.config, self.max_model_len = rank, world_size, config, max_model_len
        self.worker = None

    def node_info(self) -> tuple[str, str, list[int]]:
        """(node id, node IP, GPU ids Ray gave this actor)."""
        import ray
        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), ray.util.get_node_ip_address(), [int(g) for g in ray.get_gpu_ids()]

    def free_port(self) -> int:
        from kvforge.distributed.mp import free_port
        return free_port("0.0.0.0")

    def setup(self, init_method: str, visible_gpus: str | None, device_index: int) -> None:
        if visible_gpus is not None:  # every GPU of the node visible, so NCCL can use peer access
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_gpus
        from kvforge.distributed.worker import Worker
        self.worker = Worker(self.rank, self.world_size, self.config, self.max_model_len, device_index, init_method)

    def call(self, method: str, args: tuple) -> Any:
        return getattr(self.worker, method)(*args)


class RayExecutor(DistributedExecutor):
    """``world_size`` :class:`RayWorker` actors in a placement group (see module docstring)."""

    def __init__(self, config, max_model_len: int, device: torch.device) -> None:
        super().__init__(config, max_model_len, device)
        try:
            import ray
            from ray.util.placement_group import get_current_placement_group, placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise ValueError("parallel.distributed_executor_backend 'ray' needs Ray: pip install 'kvforge[ray]'") from None
        init_ray(config.parallel.ray_address)
        self._ray = ray
        gpu = device.type == "cuda"
        pg = get_current_placement_group()
        self._own_pg = pg is None
        if pg is None:
            bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
            pg = placement_group([dict(bundle) for _ in range(self.world_size)], strategy="PACK")
            try:
                ray.get(pg.ready(), timeout=self.timeout_s)
            except Exception:
                ray.util.remove_placement_group(pg)
                raise ValueError(f"parallel: Ray cannot place {self.world_size} workers of {bundle} "
                                 f"(cluster resources: {ray.cluster_resources()})") from None
        elif pg.bundle_count < self.world_size:
            raise ValueError(f"parallel: the placement group has {pg.bundle_count} bundles for "
                             f"{self.world_size} workers")
        self.pg = pg
        cls = ray.remote(RayWorker)
        cfg = config.to_transfer()
        self.actors = []
        for rank in range(self.world_size):
            opts = dict(num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
                        runtime_env=worker_runtime_env())
            self.actors.append(cls.options(**opts).remote(rank, self.world_size, cfg, max_model_len))
        infos = self._get([a.node_info.remote() for a in self.actors], self.timeout_s)
        port = self._get([self.actors[0].free_port.remote()], self.timeout_s)[0]
        init_method = f"tcp://{infos[0][1]}:{port}"
        node_gpus: dict[str, list[int]] = {}
        for node, _, gpus in infos:
            node_gpus.setdefault(node, []).extend(gpus)
        setups = []
        for a, (node, _, gpus) in zip(self.actors, infos):
            if gpu:
                all_gpus = sorted(node_gpus[node])
                setups.append(a.setup.remote(init_method, ",".join(map(str, all_gpus)), all_gpus.index(gpus[0])))
            else:
                setups.append(a.setup.remote(init_method, None, 0))
        self._get(setups, self.timeout_s)
        log.info("started %d Ray workers on nodes %s (rendezvous %s)", self.world_size,
                 sorted({i[1] for i in infos}), init_method)

    def _get(self, refs: list, timeout: float) -> list[Any]:
        """Results of ``refs`` in order; fails as soon as any one fails."""
        ray = self._ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
        results: list[Any] = [None] * len(refs)
        pending = {r: i for i, r in enumerate(refs)}
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerTimeoutError(f"Ray workers {sorted(pending.values())} did not answer within {timeout:.0f} s "
                                         "(parallel.worker_timeout_s)")
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=min(left, 1.0))
            for r in ready:
                i = pending.pop(r)
                try:
                    results[i] = ray.get(r, timeout=0)
                except RayActorError as e:
                    raise WorkerDiedError(f"Ray worker rank {i} died: {e}") from None
                except RayTaskError as e:
                    cause = e.cause if hasattr(e, "cause") else None
                    if isinstance(cause, ValueError):
                        raise ValueError(str(cause)) from None
                    raise WorkerError(f"Ray worker rank {i} failed: {type(cause).__name__ if cause else ''}: "
                                      f"{cause if cause else e}") from None
                except GetTimeoutError:  # pragma: no cover - ready refs do not time out
                    pending[r] = i
        return results

    def _send_all(self, method: str, args: tuple) -> list:
        return [a.call.remote(method, args) for a in self.actors]

    def _recv_all(self, handle: list, method: str, timeout: float) -> list[Any]:
        return self._get(handle, timeout)

    def _kill_workers(self) -> None:
        ray = self._ray
        for a in getattr(self, "actors", []):
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        if getattr(self, "_own_pg", False):
            try:
                ray.util.remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001
                pass
            self._own_pg = False
