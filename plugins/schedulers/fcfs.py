"""`fcfs` scheduler: first-come-first-served continuous batching with
preemption by recompute (vLLM's default policy before chunked prefill).

Each step: running requests first (in arrival order; usually one decode token
each), then waiting requests whose whole remaining prompt fits the token
budget. When the allocator runs out of blocks the most recently arrived running
request is preempted (its blocks freed, recomputed later).
"""
from __future__ import annotations

from collections import deque
from typing import Iterable

from pydantic import BaseModel, ConfigDict

from kvforge import hookimpl
from kvforge.engine.request import Request, RequestStatus, check_stop
from kvforge.interfaces import KVAllocator, Scheduler, SchedulerOutput

KVFORGE_HOOK_API = "1"


class FCFSSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FCFSScheduler(Scheduler):
    """Args:
        max_num_seqs: max requests per step.
        max_num_batched_tokens: max new tokens per step.
        max_model_len: max prompt + output tokens of a request.
        allocator: the KV block allocator.
    """

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 allocator: KVAllocator) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.allocator = allocator
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- queue policy hooks (subclasses override) --------------------------------------
    def pick_victim(self) -> Request:
        """Request to preempt when blocks run out: the latest arrival."""
        return max(self.running, key=lambda r: r.arrival_time)

    def _admit_order(self) -> Iterable[Request]:
        return list(self.waiting)

    # -- interface --------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # 1) running requests, oldest first.
        for req in sorted(self.running, key=lambda r: r.arrival_time):
            if req not in self.running:  # preempted earlier in this loop
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                continue
            while self.allocator.allocate_slots(req, n) is None:
                victim = self.pick_victim()
                if victim is req and len(self.running) == 1 and not out.scheduled:
                    self._fail(req, "KV cache exhausted: this request alone needs more blocks "
                               f"({self.allocator.num_blocks} total) than the cache holds", out)
                    break
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.is_finished or req not in self.running:
                continue
            out.scheduled.append(req)
            out.num_scheduled_tokens[req.request_id] = n
            budget -= n
        # 2) waiting requests, whole prompt at once (no chunking in FCFS), unless preempted this step.
        if not out.preempted:
            for req in self._admit_order():
                if len(self.running) >= self.max_num_seqs or budget <= 0:
                    break
                need = req.num_tokens - req.num_computed_tokens
                blocks = -(-req.num_tokens // self.allocator.block_size)
                if need > self.max_num_batched_tokens or blocks > self.allocator.num_blocks:
                    why = (f"prompt of {need} tokens exceeds max_num_batched_tokens="
                           f"{self.max_num_batched_tokens}" if need > self.max_num_batched_tokens else
                           f"prompt needs {blocks} KV blocks but the cache has {self.allocator.num_blocks}")
                    self.waiting.remove(req)
                    self._fail(req, why, out)
                    continue
                if need > budget:
                    break
                if req.num_computed_tokens == 0:
                    cached = self.allocator.get_computed_tokens(req)
                    req.num_computed_tokens = req.num_cached_tokens = cached
                    need = req.num_tokens - cached
                if self.allocator.allocate_slots(req, need) is None:
                    req.num_computed_tokens = 0
                    break  # FCFS: do not let later requests overtake
                self.waiting.remove(req)
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                out.scheduled.append(req)
                out.num_scheduled_tokens[req.request_id] = need
                budget -= need
        return out

    def update(self, output: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        finished: list[Request] = []
        for req in output.scheduled:
            if req.is_finished:
                continue
            req.num_computed_tokens += output.num_scheduled_tokens[req.request_id]
            for tok in sampled.get(req.request_id, ()):
                req.output_token_ids.append(tok)
                status = check_stop(req, self.max_model_len)
                if status is not None:
                    self._finish(req, status)
                    finished.append(req)
                    break
        return finished

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req in self.waiting:
                self.waiting.remove(req)
            self._finish(req, status)
            done.append(req)
        return done

    def stats(self) -> dict[str, float]:
        return {"num_running": len(self.running), "num_waiting": len(self.waiting),
                "num_preemptions": self.num_preemptions}

    # -- helpers ----------------------------------------------------------------------
    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        if req in self.running:
            self.running.remove(req)
        self.allocator.free(req)
        self.requests.pop(req.request_id, None)

    def _fail(self, req: Request, why: str, out: SchedulerOutput) -> None:
        req.error = why
        self._finish(req, RequestStatus.FINISHED_ERROR)
        out.finished.append(req)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.allocator.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        if req in out.scheduled:
            out.scheduled.remove(req)
            out.num_scheduled_tokens.pop(req.request_id, None)
        out.preempted.append(req)


def make_fcfs(scheduler_config, allocator: KVAllocator, settings, max_model_len: int) -> FCFSScheduler:
    return FCFSScheduler(scheduler_config.max_num_seqs, scheduler_config.max_num_batched_tokens,
                         max_model_len, allocator)


@hookimpl
def kvforge_register_schedulers(register) -> None:
    register("fcfs", make_fcfs, FCFSSettings)
