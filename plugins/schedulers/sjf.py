"""`sjf` scheduler: shortest remaining prompt first (an example policy; it can
starve long prompts under sustained load, which the A/B harness shows)."""
from __future__ import annotations

from kvforge import hookimpl
from kvforge.engine.request import Request
from kvforge_plugins.schedulers.base import QueueScheduler, QueueSettings, queue_factory

KVFORGE_HOOK_API = "1"


class SJFScheduler(QueueScheduler):
    enable_chunking = True

    def waiting_order(self) -> list[Request]:
        return sorted(self.waiting, key=lambda r: (r.num_tokens - r.num_computed_tokens, r.arrival_time))


@hookimpl
def kvforge_register_schedulers(register) -> None:
    register("sjf", queue_factory(SJFScheduler), QueueSettings, chunked_prefill=True, priorities=False,
             spec_decode=True)
