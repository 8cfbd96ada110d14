"""The engine's run-time check of a scheduler plugin's step.

A scheduler that breaks its contract (more than ``max_num_seqs`` requests or more than
``max_num_batched_tokens`` tokens in one step) would otherwise run: the engine would
silently do more work per step than configured, and an A/B comparison would credit the
broken scheduler with flattering latencies; a finished request scheduled again would fail
later, far from the plugin. The checks are O(batch) per step (a dict lookup and a count per
request, at most ``max_num_seqs`` of them), so they are always on; the conformance suite
(``pytest --kvforge-conformance scheduler:NAME``) checks the full contract.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Container

from kvforge.interfaces import SchedulerOutput

if TYPE_CHECKING:
    from kvforge.interfaces import Scheduler


class SchedulerContractError(RuntimeError):
    """A scheduler plugin returned a step outside its limits."""


def checked_schedule(scheduler: "Scheduler", who: str, max_num_seqs: int, max_num_batched_tokens: int | None,
                     live_parents: "Container[str] | None" = None) -> "SchedulerOutput":
    """``scheduler.schedule()``, with its limits checked and its errors attributed to the plugin
    (an exception from ``schedule()`` propagates as it is, with a note naming the plugin).

    Args:
        who: the plugin, as :func:`kvforge.engine.capabilities.describe` names it.
        max_num_batched_tokens: the step's token budget (None: unchecked).
        live_parents: the user request ids still in flight (None: unchecked); every scheduled
            request's ``parent_id`` must be one of them.

    Raises:
        SchedulerContractError: the step has more than ``max_num_seqs`` requests, a request
            no longer in flight, or more tokens than the budget.
    """
    so = _attributed(scheduler.schedule, "schedule()", who)
    if not isinstance(so, SchedulerOutput):
        raise SchedulerContractError(f"{who}: schedule() returned {type(so).__name__}, not a SchedulerOutput")
    if len(so.scheduled) > max_num_seqs:
        raise SchedulerContractError(f"{who} scheduled {len(so.scheduled)} requests in one step, more than "
                                     f"scheduler.max_num_seqs ({max_num_seqs})")
    counts = so.num_scheduled_tokens
    for req in so.scheduled:  # (a request it got wrong would fail later in the model runner, unnamed)
        if live_parents is not None and req.parent_id not in live_parents:
            raise SchedulerContractError(f"{who} scheduled request {req.request_id!r}, which has already "
                                         f"finished or was aborted: update / finish_requests must take a "
                                         f"finished request out of the scheduler's queues")
        got = counts.get(req.request_id)
        if not isinstance(got, int) or got < 1:
            raise SchedulerContractError(f"{who} scheduled request {req.request_id!r} with "
                                         f"num_scheduled_tokens {got!r}: every scheduled request needs a count "
                                         f">= 1 (and an unscheduled one none)")
    total = sum(counts.values())
    if max_num_batched_tokens is not None and total > max_num_batched_tokens:
        raise SchedulerContractError(f"{who} scheduled {total} tokens in one step, more than "
                                     f"scheduler.max_num_batched_tokens ({max_num_batched_tokens})")
    return so


def checked_update(scheduler: "Scheduler", who: str, so: "SchedulerOutput", sampled: dict) -> None:
    """``scheduler.update(so, sampled)``, its errors attributed to the plugin as
    :func:`checked_schedule` does."""
    _attributed(lambda: scheduler.update(so, sampled), "update()", who)


def _attributed(call, what: str, who: str):
    """``call()``; an exception gets a note naming the plugin and the method (its type stays:
    callers and tests catch by type, and the allocator's own errors surface here too), and a
    ``sys.exit()`` inside the plugin becomes a SchedulerContractError naming it instead of
    ending the process (a server would otherwise die with nothing in its log)."""
    try:
        return call()
    except SystemExit as e:
        raise SchedulerContractError(f"{who} called sys.exit({e.code!r}) in {what}") from e
    except Exception as e:
        e.add_note(f"kvforge: raised during {what} of {who}")
        raise
