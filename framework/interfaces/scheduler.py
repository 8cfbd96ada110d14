"""Scheduler interface: decides, each step, which requests run and how many tokens each."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

from kvforge.hookspecs import KVFORGE_HOOK_API

if TYPE_CHECKING:
    from kvforge.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """What one engine step runs.

    Attributes:
        scheduled: requests to run this step, in batch order.
        num_scheduled_tokens: request_id -> number of new tokens (>= 1) to compute
            this step, starting at ``request.num_computed_tokens``. A prompt chunk
            and a decode token are the same thing here (DESIGN.md, core loop).
        preempted: requests preempted this step (their blocks are already freed).
        finished: requests the scheduler ended this step without running them
            (e.g. a prompt that can never fit); they carry ``status`` and ``error``.
        swap_out: (device block, CPU block) pairs to copy out before the forward.
        swap_in: (CPU block, device block) pairs to copy in before the forward.
            A step never carries both (a scheduler must not resume and swap out
            in one step), so block ids freed by one are safe to reuse.
        on_step_done: callbacks the scheduler runs at the end of ``update``.
        spec_token_ids: request_id -> draft tokens verified this step (speculative
            decoding). Such a request is a decode whose ``num_scheduled_tokens`` is
            ``1 + len(drafts)``: its last token followed by the drafts, in lookahead
            slots (``allocate_slots(req, 1, num_lookahead_tokens=len(drafts))``). In
            ``update``, ``num_computed_tokens`` then advances by ``len(sampled[rid])``
            (1 + accepted drafts) and the rejected drafts' slots are rolled back with
            ``KVAllocator.free_tail``. Set by the scheduler from ``request.spec_token_ids``
            (possibly trimmed to fit the token budget or free blocks).
        decode_batch: optional, for a step of plain decodes only (every scheduled request
            computes its last token, no drafts): ``(rows, num_computed, num_computed_list)``:
            the requests' rows in the allocator's ``table_array`` (int64 [B]) and their
            ``num_computed_tokens`` at scheduling time (int64 [B], and as a list), so the
            model runner need not read them again; nothing may change them before the step
            runs. Built-in schedulers set it; None (the default) means unknown.
    """

    scheduled: list["Request"] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted: list["Request"] = field(default_factory=list)
    finished: list["Request"] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    on_step_done: list = field(default_factory=list)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    decode_batch: tuple | None = None

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass(frozen=True)
class SchedulerContext:
    """Engine facts a scheduler factory receives besides its config section.

    Attributes:
        max_model_len: max prompt + output tokens of a request.
        num_cpu_blocks: size of the CPU swap pool in blocks (0 = no swap space).
    """

    max_model_len: int
    num_cpu_blocks: int = 0


class Scheduler(ABC):
    """Continuous-batching scheduler (Orca, Yu et al. OSDI'22; vLLM's V1 unified form).

    A scheduler owns the waiting and running queues and asks its
    :class:`~kvforge.interfaces.KVAllocator` for blocks; it must keep, every
    step, ``len(scheduled) <= max_num_seqs`` and
    ``total_num_scheduled_tokens <= max_num_batched_tokens``.
    """

    KVFORGE_HOOK_API = KVFORGE_HOOK_API

    @abstractmethod
    def add_request(self, request: "Request") -> None:
        """Queue a validated request (status WAITING)."""

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts; allocate their KV slots."""

    @abstractmethod
    def update(self, output: SchedulerOutput, sampled: dict[str, list[int]]) -> list["Request"]:
        """Advance ``num_computed_tokens`` by the scheduled counts, append ``sampled``
        token ids (request_id -> new tokens; absent for a mid-prompt chunk), apply
        token-level stop checks (EOS, stop_token_ids, max_tokens, max_model_len)
        and free finished requests' blocks.

        Returns: the requests that finished during this update.
        """

    @abstractmethod
    def finish_requests(self, request_ids: Iterable[str], status: "RequestStatus") -> list["Request"]:
        """End requests from outside (abort, stop string, error); free their blocks.
        Unknown or already finished ids are ignored. Returns the requests ended."""

    @abstractmethod
    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting, running or preempted."""

    def admission_error(self, num_prompt_tokens: int) -> str | None:
        """Why a prompt of ``num_prompt_tokens`` tokens could never be scheduled, or None.

        The engine asks this while validating a request, before any state changes, and
        refuses the request with ``ValueError("prompt: <reason>")`` (HTTP 400 from the server),
        so a prompt this scheduler cannot run fails up front instead of at its turn.
        Default: None (the scheduler knows no such limit).
        """
        return None

    def stats(self) -> dict[str, float]:
        """Counters for metrics: num_running, num_waiting, num_preemptions..."""
        return {}
