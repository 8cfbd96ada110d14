"""`chunked_prefill` scheduler (the default): FCFS order, and each step fills the
token budget with running decodes first, then prefill chunks, so a long prompt
is split across steps and never stalls running decodes (Sarathi-Serve,
Agrawal et al. OSDI'24)."""
from __future__ import annotations

from kvforge import hookimpl
from kvforge_plugins.schedulers.base import QueueScheduler, QueueSettings, queue_factory

KVFORGE_HOOK_API = "1"


class ChunkedPrefillScheduler(QueueScheduler):
    enable_chunking = True


@hookimpl
def kvforge_register_schedulers(register) -> None:
    register("chunked_prefill", queue_factory(ChunkedPrefillScheduler), QueueSettings, chunked_prefill=True,
             priorities=False, spec_decode=True)
