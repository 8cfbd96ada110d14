"""``cache_aware``: a kvforge scheduler that admits cached prefixes first.

Among waiting requests it admits first those with the longest prefix already in
the KV cache (SGLang's longest-prefix-match policy, Zheng et al. 2024): they
cost fewer prefill tokens and, admitted while their blocks are still cached,
they hit before those blocks are evicted. To bound unfairness, a request that
has waited ``max_wait_steps`` engine steps goes ahead of every cache-preferred
one, in arrival order.

Everything else (continuous batching, chunked prefill, preemption by recompute
or swap) is kvforge's :class:`~kvforge_plugins.schedulers.base.QueueScheduler`;
the only override is :meth:`CacheAwareScheduler.waiting_order`. The probe of
the cache is side-effect free (:mod:`kvforge_cache_aware.peek`).

Registered as scheduler ``cache_aware`` through the entry point
``kvforge.plugins: cache_aware = "kvforge_cache_aware"``, with the capability
``requires_prefix_caching=True`` (the engine refuses it with an allocator that
cannot cache prefixes, or with ``cache.enable_prefix_caching`` off).
"""
from __future__ import annotations

from pydantic import Field

from kvforge import hookimpl
from kvforge.engine.request import Request
from kvforge_cache_aware.peek import peek_computed_tokens, prefix_hashes
from kvforge_plugins.schedulers.base import QueueScheduler, QueueSettings

#: The kvforge hook API this plugin targets (checked at load).
KVFORGE_HOOK_API = "1"

__version__ = "0.1.0"


class CacheAwareSettings(QueueSettings):
    """``scheduler.settings`` of ``cache_aware`` (plus the built-in queue settings:
    ``preemption_mode``, ``long_prefill_token_threshold``)."""

    max_wait_steps: int = Field(64, ge=0, description="Steps after which a waiting request is admitted in "
                                                      "arrival order ahead of cache hits (0 = plain FCFS).")


class CacheAwareScheduler(QueueScheduler):
    """Chunked-prefill continuous batching with longest-cached-prefix-first admission."""

    enable_chunking = True

    def __init__(self, *args, settings: CacheAwareSettings | None = None, **kwargs) -> None:
        settings = settings or CacheAwareSettings()
        super().__init__(*args, settings=settings, **kwargs)
        self.max_wait_steps = settings.max_wait_steps
        self._step = 0
        self._since: dict[str, int] = {}                              # request id -> step it arrived
        self._hashes: dict[str, tuple[int, list]] = {}                # request id -> (num_tokens, hashes)

    def add_request(self, request: Request) -> None:
        super().add_request(request)
        self._since.setdefault(request.request_id, self._step)

    def schedule(self):
        self._step += 1
        return super().schedule()

    def cached_tokens(self, request: Request) -> int:
        """Side-effect-free: tokens of ``request`` the allocator holds now."""
        key = self._hashes.get(request.request_id)
        if key is None or key[0] != request.num_tokens:
            key = (request.num_tokens, prefix_hashes(request, self.allocator.block_size))
            self._hashes[request.request_id] = key
        return peek_computed_tokens(self.allocator, request, key[1])

    def waiting_order(self) -> list[Request]:
        by_arrival = sorted(self.waiting, key=lambda r: r.arrival_time)
        if self.max_wait_steps == 0:
            return by_arrival
        overdue = [r for r in by_arrival if self._step - self._since.get(r.request_id, self._step)
                   >= self.max_wait_steps]
        rest = [r for r in by_arrival if r not in overdue]
        rest.sort(key=lambda r: -self.cached_tokens(r))  # stable: arrival order among equals
        return overdue + rest

    def _finish(self, req: Request, status) -> None:
        super()._finish(req, status)
        self._since.pop(req.request_id, None)
        self._hashes.pop(req.request_id, None)


def make_cache_aware(scheduler_config, allocator, settings, ctx) -> CacheAwareScheduler:
    """Scheduler hook factory: ``(scheduler_config, allocator, settings, ctx) -> Scheduler``."""
    return CacheAwareScheduler(scheduler_config.max_num_seqs, scheduler_config.max_num_batched_tokens,
                               ctx.max_model_len, allocator, settings=settings, num_cpu_blocks=ctx.num_cpu_blocks)


@hookimpl
def kvforge_register_schedulers(register) -> None:
    register("cache_aware", make_cache_aware, CacheAwareSettings, requires_prefix_caching=True,
             chunked_prefill=True)
