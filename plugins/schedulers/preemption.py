"""Preemption policies: what happens to a victim's KV when blocks run out.

``recompute`` drops the KV and later re-runs the prompt and generated tokens as
a prefill (vLLM's default: cheap when prefill is fast). ``swap`` copies the
victim's blocks to a CPU block pool and back on resumption (vLLM V0's swap
mode; PagedAttention paper §4.5), keeping its computed tokens.
"""
from __future__ import annotations

from collections import deque

from kvforge.engine.request import Request
from kvforge.interfaces import KVAllocator, SchedulerOutput


class RecomputePolicy:
    """Free the victim's blocks; it restarts from ``num_computed_tokens = 0``."""

    name = "recompute"

    def preempt(self, req: Request, allocator: KVAllocator, out: SchedulerOutput) -> None:
        allocator.free(req)
        req.num_computed_tokens = 0

    def on_resume(self, req: Request, allocator: KVAllocator, out: SchedulerOutput) -> None:
        pass

    def can_resume(self, req: Request) -> bool:
        return True

    def release(self, req: Request) -> None:
        pass


class SwapPolicy:
    """Move the victim's blocks to a CPU pool of ``num_cpu_blocks``; falls back to
    recompute when the pool is full. The model runner performs the copies listed
    in ``SchedulerOutput.swap_out`` / ``swap_in`` before the step's forward.
    """

    name = "swap"

    def __init__(self, num_cpu_blocks: int) -> None:
        if num_cpu_blocks <= 0:
            raise ValueError("scheduler.settings.preemption_mode 'swap' needs cache.swap_space_bytes > 0")
        self.num_cpu_blocks = num_cpu_blocks
        self._free: deque[int] = deque(range(num_cpu_blocks))
        self._held: dict[str, list[int]] = {}
        self._fallback = RecomputePolicy()

    def preempt(self, req: Request, allocator: KVAllocator, out: SchedulerOutput) -> None:
        bs = allocator.block_size
        used = -(-req.num_computed_tokens // bs)
        gpu = allocator.get_block_table(req.request_id)[:used]
        if used == 0 or used > len(self._free):
            self._fallback.preempt(req, allocator, out)
            return
        cpu = [self._free.popleft() for _ in gpu]
        out.swap_out.extend(zip(gpu, cpu))
        self._held[req.request_id] = cpu
        allocator.free(req)  # ids return now; the runner copies before this step's forward

    def can_resume(self, req: Request) -> bool:
        return True

    def on_resume(self, req: Request, allocator: KVAllocator, out: SchedulerOutput) -> None:
        cpu = self._held.pop(req.request_id, None)
        if not cpu:
            return
        gpu = allocator.get_block_table(req.request_id)[:len(cpu)]
        out.swap_in.extend(zip(cpu, gpu))
        # CPU ids are reused only from the next step on: the copy-in runs first.
        out.on_step_done.append(lambda ids=cpu: self._free.extend(ids))

    def release(self, req: Request) -> None:
        cpu = self._held.pop(req.request_id, None)
        if cpu:
            self._free.extend(cpu)

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self._free)
