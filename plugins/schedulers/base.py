"""QueueScheduler: the shared machinery of the built-in schedulers.

One step (vLLM V1's unified scheduling, Sarathi-Serve's stall-free batching when
chunking is on, Agrawal et al. OSDI'24):

1. running requests that are decoding get their token first;
2. running requests still in prefill get chunks from what budget is left;
3. waiting requests are admitted in ``waiting_order()`` while the token budget,
   ``max_num_seqs`` and free blocks allow.

When the allocator runs out of blocks, ``pick_victim()`` chooses whom to
preempt and the preemption policy (recompute or swap) decides what happens to
its KV. Subclasses change only the policies.
"""
from __future__ import annotations

from typing import Iterable, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvforge.engine.request import Request, RequestStatus, check_stop
from kvforge.interfaces import KVAllocator, Scheduler, SchedulerContext, SchedulerOutput
from kvforge_plugins.schedulers.decode_batch import DecodeBatch
from kvforge_plugins.schedulers.preemption import RecomputePolicy, SwapPolicy


class QueueSettings(BaseModel):
    """Settings shared by the built-in schedulers (``scheduler.settings``)."""

    model_config = ConfigDict(extra="forbid")
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    long_prefill_token_threshold: int = Field(
        0, ge=0, description="Max prefill tokens one request may take per step (0 = no cap).")


class QueueScheduler(Scheduler):
    """Args:
        max_num_seqs: max requests per step; max_num_batched_tokens: max new tokens per step.
        enable_chunking: split prompts across steps (else a prompt runs whole or waits).
    """

    enable_chunking = True

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 allocator: KVAllocator, settings: QueueSettings | None = None, num_cpu_blocks: int = 0) -> None:
        settings = settings or QueueSettings()
        if settings.long_prefill_token_threshold and not self.enable_chunking:
            # a prompt longer than the cap could never run whole, and this scheduler cannot split it
            raise ValueError(f"scheduler.settings.long_prefill_token_threshold: caps prefill chunks, and "
                             f"{type(self).__name__} does not chunk prefills (a prompt runs whole); leave it 0, "
                             f"or use a chunking scheduler (chunked_prefill)")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.allocator = allocator
        self.long_prefill_token_threshold = settings.long_prefill_token_threshold
        self.preemption = SwapPolicy(num_cpu_blocks) if settings.preemption_mode == "swap" else RecomputePolicy()
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        self._decode_batch = DecodeBatch(allocator, max_model_len)  # vectorized all-decode steps (paged allocator)
        # every EOS / stop id of a request added or admitted so far: update's cheap pre-filter
        # of check_stop (a superset is fine: check_stop decides)
        self._stop_ids: set[int] = set()

    # -- policies (override in subclasses) ------------------------------------------------
    def waiting_order(self) -> list[Request]:
        """Admission order. Default: arrival (FCFS); preempted requests keep their place."""
        return sorted(self.waiting, key=lambda r: r.arrival_time)

    def pick_victim(self) -> Request:
        """Request to preempt when blocks run out. Default: the latest arrival."""
        return max(self.running, key=lambda r: r.arrival_time)

    # -- interface ------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._stop_ids.update(request.eos_token_ids, request.sampling_params.stop_token_ids)
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk(self, remaining: int, budget: int) -> int:
        n = min(remaining, budget)
        if self.long_prefill_token_threshold and remaining > 1:
            n = min(n, self.long_prefill_token_threshold)
        return n

    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput, lookahead: int = 0) -> bool:
        """Allocate ``n`` new tokens' slots (+ ``lookahead`` slots for draft tokens) for a
        running request, preempting as needed. Drafts never cause a preemption: they get
        lookahead slots only while, after them, a block per not-yet-scheduled running
        request stays free. Returns False if ``req`` itself was preempted or failed."""
        if lookahead:
            reserve = len(self.running) - len(out.scheduled) + -(-lookahead // self.allocator.block_size)
            if self.allocator.num_free_blocks > reserve and \
                    self.allocator.allocate_slots(req, n, num_lookahead_tokens=lookahead) is not None:
                return True
        req.spec_token_ids = []
        while self.allocator.allocate_slots(req, n) is None:
            if len(self.running) == 1:
                self._fail(req, f"KV cache exhausted: this request alone needs more than the "
                                f"{self.allocator.num_blocks} blocks the cache holds", out)
                return False
            victim = self.pick_victim()
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self._decode_batch.available and self._decode_batch.schedule(self.running, self.max_num_batched_tokens, out):
            budget = self.max_num_batched_tokens - len(out.scheduled)  # one token each
        else:
            self._schedule_running(out)
            budget = self.max_num_batched_tokens - out.total_num_scheduled_tokens
        # 3) waiting requests; never in a step that preempted (keeps swap-in and swap-out apart).
        if out.preempted:
            return out
        for req in self.waiting_order():
            if len(self.running) >= self.max_num_seqs or budget <= 0:
                break
            fresh = req.num_computed_tokens == 0
            if fresh:
                reason = self._never_fits(req) if req.num_preemptions == 0 else None
                if reason:
                    self.waiting.remove(req)
                    self._fail(req, reason, out)
                    continue
                req.num_computed_tokens = self.allocator.get_computed_tokens(req)
                if req.num_preemptions == 0:  # (vLLM's meaning: prompt tokens served from the cache at
                    req.num_cached_tokens = req.num_computed_tokens  # admission; a recompute's hits do not count)
            remaining = req.num_tokens - req.num_computed_tokens
            n = self._chunk(remaining, budget)
            if (n < remaining and not self._may_chunk(req)) or self.allocator.allocate_slots(req, n) is None:
                if fresh:  # forget the prefix-cache hit; it is looked up again next time
                    req.num_computed_tokens = 0
                    if req.num_preemptions == 0:
                        req.num_cached_tokens = 0
                break  # keep the order: later requests do not overtake
            self.waiting.remove(req)
            self._stop_ids.update(req.eos_token_ids, req.sampling_params.stop_token_ids)  # (also in add_request)
            self.preemption.on_resume(req, self.allocator, out)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(req)
            out.num_scheduled_tokens[req.request_id] = n
            budget -= n
            out.decode_batch = None  # no longer a step of decodes only
        return out

    def _schedule_running(self, out: SchedulerOutput) -> None:
        """Steps 1) and 2), one request at a time (the general path)."""
        budget = self.max_num_batched_tokens
        # 1) + 2): running decodes first, then running prefills (chunks).
        # (lengths inline, not through properties: this runs for every running request)
        decodes, prefills = [], []
        for r in self.running:
            (decodes if len(r.prompt_token_ids) + len(r.output_token_ids) - r.num_computed_tokens == 1
             else prefills).append(r)
        num_decodes = len(decodes)
        allocate = self.allocator.allocate_slots
        running_status = RequestStatus.RUNNING
        for i, req in enumerate(decodes + prefills):
            if budget <= 0:
                break
            if req.status is not running_status:  # preempted as a victim earlier in this loop
                continue
            if i < num_decodes and not req.spec_token_ids:
                # plain decode, the common case: keep it cheap (runs for every running request)
                if allocate(req, 1) is None and not self._allocate_or_preempt(req, 1, out, 0):
                    continue
                out.scheduled.append(req)
                out.num_scheduled_tokens[req.request_id] = 1
                budget -= 1
                continue
            n = self._chunk(req.num_tokens - req.num_computed_tokens, budget)
            if n < req.num_tokens - req.num_computed_tokens and not self._may_chunk(req):
                continue
            # Speculating decode: its drafts ride along in lookahead slots, as the budget allows.
            is_decode = req.num_tokens - req.num_computed_tokens == 1
            lookahead = min(len(req.spec_token_ids), budget - n) if is_decode else 0
            if not self._allocate_or_preempt(req, n, out, lookahead):
                continue
            if req.spec_token_ids:
                del req.spec_token_ids[lookahead:]
                out.spec_token_ids[req.request_id] = list(req.spec_token_ids)
                n += len(req.spec_token_ids)
            out.scheduled.append(req)
            out.num_scheduled_tokens[req.request_id] = n
            budget -= n

    def _may_chunk(self, req: Request) -> bool:
        # A non-chunking scheduler never splits a prompt, but a preempted request's
        # recompute (prompt + generated tokens) may exceed the budget: split that.
        return self.enable_chunking or req.num_preemptions > 0

    def _never_fits(self, req: Request) -> str | None:
        return QueueScheduler.admission_error(self, req.num_tokens)  # the backstop, whatever a subclass allows

    def admission_error(self, num_prompt_tokens: int) -> str | None:
        blocks = -(-num_prompt_tokens // self.allocator.block_size)
        if blocks > self.allocator.num_blocks:
            return f"{num_prompt_tokens} tokens need {blocks} KV blocks but the cache has {self.allocator.num_blocks}"
        if not self.enable_chunking and num_prompt_tokens > self.max_num_batched_tokens:
            return (f"{num_prompt_tokens} tokens exceed scheduler.max_num_batched_tokens "
                    f"({self.max_num_batched_tokens}) and this scheduler does not chunk prefills")
        return None

    def update(self, output: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        finished: list[Request] = []
        if not output.spec_token_ids:
            maybe = self._decode_batch.update(output, sampled, self._stop_ids)
            if maybe is None:
                self._update_plain(output.scheduled, output.num_scheduled_tokens, sampled, finished)
            for req in maybe or ():  # tokens appended already; only these may stop
                status = check_stop(req, self.max_model_len)
                if status is not None:
                    self._finish(req, status)
                    finished.append(req)
        else:
            self._update_speculative(output, sampled, finished)
        for fn in output.on_step_done:
            fn()
        return finished

    def _update_speculative(self, output: SchedulerOutput, sampled: dict[str, list[int]],
                            finished: list[Request]) -> None:
        """``update`` of a step verifying drafts (``output.spec_token_ids``)."""
        spec = output.spec_token_ids
        counts = output.num_scheduled_tokens
        running = RequestStatus.RUNNING
        for req in output.scheduled:
            if req.status is not running and req.is_finished:
                continue
            rid = req.request_id
            toks = sampled.get(rid, ())
            drafts = spec.get(rid)
            if drafts:  # speculative: the last token plus the accepted drafts now have KV
                req.num_computed_tokens += counts[rid] - len(drafts) + max(0, len(toks) - 1)
            else:
                req.num_computed_tokens += counts[rid]
            if req.spec_token_ids:
                req.spec_token_ids = []
            for tok in toks:
                req.output_token_ids.append(tok)
                status = check_stop(req, self.max_model_len)
                if status is not None:
                    self._finish(req, status)
                    finished.append(req)
                    break
            if drafts and not req.is_finished:  # roll back the rejected drafts' slots
                self.allocator.free_tail(req, req.num_computed_tokens)

    def _update_plain(self, scheduled: list[Request], counts: dict[str, int], sampled: dict[str, list[int]],
                      finished: list[Request]) -> None:
        """``update`` of a step without drafts: the same effects, with ``check_stop`` called
        only for a token that could stop the request (a listed stop id, a length limit),
        since this runs for every request every step."""
        get = sampled.get
        stop_ids = self._stop_ids
        max_model_len = self.max_model_len
        running = RequestStatus.RUNNING
        for req in scheduled:
            if req.status is not running and req.is_finished:
                continue
            rid = req.request_id
            req.num_computed_tokens += counts[rid]
            if req.spec_token_ids:
                req.spec_token_ids = []
            toks = get(rid)
            if not toks:
                continue
            out = req.output_token_ids
            for tok in toks:
                out.append(tok)
                n = len(out)
                if tok in stop_ids or n >= req.max_tokens or n + len(req.prompt_token_ids) >= max_model_len:
                    status = check_stop(req, max_model_len)
                    if status is not None:
                        self._finish(req, status)
                        finished.append(req)
                        break

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
                "num_preemptions": self.num_preemptions, "num_recomputed_tokens": self.num_recomputed_tokens}

    # -- helpers --------------------------------------------------------------------------
    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        req.spec_token_ids = []
        if req in self.running:
            self.running.remove(req)
        self.allocator.free(req)
        self.preemption.release(req)
        self.requests.pop(req.request_id, None)

    def _fail(self, req: Request, why: str, out: SchedulerOutput) -> None:
        req.error = why
        self._finish(req, RequestStatus.FINISHED_ERROR)
        out.finished.append(req)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        req.spec_token_ids = []
        if req in out.scheduled:
            out.scheduled.remove(req)
            out.num_scheduled_tokens.pop(req.request_id, None)
            out.spec_token_ids.pop(req.request_id, None)
        computed = req.num_computed_tokens
        self.preemption.preempt(req, self.allocator, out)
        self.num_recomputed_tokens += computed - req.num_computed_tokens
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(req)
        out.preempted.append(req)


def queue_factory(cls: type[QueueScheduler]):
    """Factory matching the scheduler hook's signature for a QueueScheduler subclass."""

    def make(scheduler_config, allocator: KVAllocator, settings, ctx: SchedulerContext) -> QueueScheduler:
        return cls(scheduler_config.max_num_seqs, scheduler_config.max_num_batched_tokens, ctx.max_model_len,
                   allocator, settings, ctx.num_cpu_blocks)

    return make
