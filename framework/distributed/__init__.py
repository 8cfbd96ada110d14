"""Distributed inference (docs/distributed.md): tensor, pipeline, expert and data parallelism.

* :mod:`~kvforge.distributed.parallel_state` — process groups, this rank's place (tp/pp/ep).
* :mod:`~kvforge.distributed.communication` — the collectives the parallel layers use.
* :mod:`~kvforge.distributed.protocol` — what a step sends to the workers.
* :mod:`~kvforge.distributed.worker` — one rank: model shard, KV caches, forward (GPipe micro-batches).
* :mod:`~kvforge.distributed.executor_base`, :mod:`~kvforge.distributed.mp`,
  :mod:`~kvforge.distributed.ray_executor` — the driver side and its two transports.
* :mod:`~kvforge.distributed.launch` — engine build when the model lives on workers.
* :mod:`~kvforge.distributed.data_parallel` — replicas behind one engine-shaped front end.
"""
