"""`fcfs` scheduler: first-come-first-served continuous batching without
prompt chunking (a prompt runs whole in one step or waits); preemption of the
latest arrival when blocks run out."""
from __future__ import annotations

from kvforge import hookimpl
from kvforge_plugins.schedulers.base import QueueScheduler, QueueSettings, queue_factory

KVFORGE_HOOK_API = "1"


class FCFSScheduler(QueueScheduler):
    enable_chunking = False


make_fcfs = queue_factory(FCFSScheduler)


@hookimpl
def kvforge_register_schedulers(register) -> None:
    register("fcfs", make_fcfs, QueueSettings, chunked_prefill=False, priorities=False, spec_decode=True)
