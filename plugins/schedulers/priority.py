"""`priority` scheduler: admits by (priority, arrival) — a lower value is more
important, as in vLLM — and preempts the least important running request first."""
from __future__ import annotations

from kvforge import hookimpl
from kvforge.engine.request import Request
from kvforge_plugins.schedulers.base import QueueScheduler, QueueSettings, queue_factory

KVFORGE_HOOK_API = "1"


class PriorityScheduler(QueueScheduler):
    enable_chunking = True

    def waiting_order(self) -> list[Request]:
        return sorted(self.waiting, key=lambda r: (r.priority, r.arrival_time))

    def pick_victim(self) -> Request:
        return max(self.running, key=lambda r: (r.priority, r.arrival_time))


@hookimpl
def kvforge_register_schedulers(register) -> None:
    register("priority", queue_factory(PriorityScheduler), QueueSettings, chunked_prefill=True,
             priorities=True, spec_decode=True)
