"""Shared machinery of the conformance suites.

A suite check is a plain function ``check_xxx(target: Target) -> None`` that
raises ``AssertionError`` (with a message naming the plugin and the seed) on a
violation and calls ``pytest.skip`` when a check cannot apply (a shape the
backend's ``validate`` rejects, an engine feature not built yet). The
``--kvforge-conformance`` pytest option and :func:`kvforge.testing.conformance_cases`
both run these functions.

Everything goes through the real plugin registry: a :class:`Target` names a
registered plugin by kind and name, and engines are built with
``LLMEngine(config, registry=target.registry)`` exactly as ``kvforge generate``
builds them.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

if TYPE_CHECKING:
    from kvforge.engine.llm_engine import LLMEngine
    from kvforge.engine.outputs import RequestOutput
    from kvforge.plugin_manager import PluginSpec, Registry

#: Plugin kinds that have a conformance suite (``KIND`` in ``--kvforge-conformance KIND:NAME``).
SUITE_KINDS = ("kv_allocator", "scheduler", "attention", "quantizer", "drafter")
#: Environment variable naming the model directory the engine-driven checks run on.
MODEL_ENV = "KVFORGE_TEST_MODEL"
#: Environment variable fixing the suites' random seed (default: a fresh one per check, printed).
SEED_ENV = "KVFORGE_TEST_SEED"
#: Environment variable choosing the kernel shape grid: ``full`` (default) or ``small``.
GRID_ENV = "KVFORGE_TEST_GRID"
#: The model the suites are written for: Karpathy's stories260K in Hugging Face layout.
DEFAULT_MODEL_NAME = "stories260K"


def default_model_path() -> str | None:
    """The model directory for engine-driven checks, or None if none is found.

    Order: ``$KVFORGE_TEST_MODEL``; ``<repo>/../shared/models/stories260K`` next to
    the kvforge checkout this package was imported from; ``../shared/models/stories260K``
    and ``shared/models/stories260K`` relative to the working directory.
    """
    env = os.environ.get(MODEL_ENV)
    if env:
        return env
    import kvforge
    pkg = Path(kvforge.__file__).resolve().parent
    candidates = [pkg.parents[1] / "shared" / "models" / DEFAULT_MODEL_NAME,
                  Path.cwd() / ".." / "shared" / "models" / DEFAULT_MODEL_NAME,
                  Path.cwd() / "shared" / "models" / DEFAULT_MODEL_NAME]
    for c in candidates:
        if (c / "config.json").is_file():
            return str(c.resolve())
    return None


_DEFAULT_REGISTRY: "Registry | None" = None


def default_registry() -> "Registry":
    """The registry of every installed plugin (entry points, allow/block lists applied), loaded once."""
    global _DEFAULT_REGISTRY
    if _DEFAULT_REGISTRY is None:
        from kvforge.plugin_manager import load_registry
        _DEFAULT_REGISTRY = load_registry()
    return _DEFAULT_REGISTRY


def fresh_seed() -> int:
    """``$KVFORGE_TEST_SEED`` if set, else a new random seed."""
    raw = os.environ.get(SEED_ENV)
    return int(raw) if raw else int.from_bytes(os.urandom(4), "little")


@dataclass
class Target:
    """The plugin under test.

    Attributes:
        kind: one of :data:`SUITE_KINDS`.
        name: the registered name (``scheduler.name``, ``cache.allocator``...).
        registry: where to find it (default: every installed plugin).
        model: model directory for engine-driven checks (default :func:`default_model_path`).
        device: ``auto``, ``cpu`` or ``cuda`` (engine ``model.device``; attention/quantizer tensors).
        settings: the plugin's ``settings`` section (validated by its own model), default ``{}``.
        grid: ``full`` or ``small`` shape grid for the kernel suites (default ``$KVFORGE_TEST_GRID`` or
            ``full``; ``small`` is for slow emulated devices such as Triton's CPU interpreter).
    """

    kind: str
    name: str
    registry: "Registry" = None  # type: ignore[assignment]
    model: str | None = None
    device: str = "auto"
    settings: dict[str, Any] = field(default_factory=dict)
    grid: str | None = None

    def __post_init__(self) -> None:
        if self.grid is None:
            self.grid = os.environ.get(GRID_ENV) or "full"
        if self.grid not in ("full", "small"):
            raise ValueError(f"grid must be 'full' or 'small', got {self.grid!r}")
        if self.kind not in SUITE_KINDS:
            raise ValueError(f"unknown conformance kind {self.kind!r}; kinds: {', '.join(SUITE_KINDS)}")
        if self.registry is None:
            self.registry = default_registry()
        if self.model is None:
            self.model = default_model_path()

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}"

    @property
    def spec(self) -> "PluginSpec":
        """The registry entry; ValueError listing the registered names if absent."""
        return self.registry.get(self.kind, self.name)

    @property
    def capabilities(self) -> dict[str, Any]:
        return dict(self.spec.capabilities)

    def torch_device(self):
        import torch
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def rng(self, label: str) -> tuple[random.Random, str]:
        """A seeded RNG and a tag ``"<target> <label> seed=N"`` to put in failure messages."""
        seed = fresh_seed()
        tag = f"[{self} {label} seed={seed}; rerun with {SEED_ENV}={seed}]"
        print(tag)
        return random.Random(seed), tag

    def require_model(self) -> str:
        if not self.model or not (Path(self.model) / "config.json").is_file():
            raise AssertionError(
                f"{self}: engine-driven conformance checks need a model directory; set {MODEL_ENV} "
                f"(or --kvforge-model) to a Hugging Face-layout checkpoint such as {DEFAULT_MODEL_NAME} "
                f"(got {self.model!r})")
        return self.model

    def engine(self, **overrides: Any) -> "LLMEngine":
        """Build a real engine on the test model: float32, ``overrides`` are flat or dotted
        config keys (``scheduler="fcfs"``, ``"cache.settings": {...}``)."""
        from kvforge.config import EngineConfig
        from kvforge.engine.llm_engine import LLMEngine
        opts: dict[str, Any] = {"model": self.require_model(), "dtype": "float32"}
        if self.device != "auto":
            opts["device"] = self.device
        opts.update(overrides)
        return LLMEngine(EngineConfig.from_sources(None, opts), registry=self.registry)


# -- engine-level invariants -------------------------------------------------------------------

class StepMonitor:
    """Wraps ``engine.scheduler`` to check, after every ``schedule()``:

    - ``len(scheduled) <= max_num_seqs`` and ``total_num_scheduled_tokens <= max_num_batched_tokens``;
    - every scheduled request appears once, is unfinished, gets ``1 <= n`` tokens with
      ``num_computed_tokens + n <= num_tokens`` and holds enough blocks for them;
    - preempted requests are not scheduled and hold no blocks; finished requests hold no blocks;
    - block accounting: ids in ``[0, num_blocks)`` and
      ``num_free_blocks == num_blocks - |union of all block tables|``
      (a shared prefix block counts once; a free block that still caches a prefix is free).

    Also records, per request id, the step it was added and the step it finished.
    """

    def __init__(self, engine: "LLMEngine", label: str = "") -> None:
        self.engine = engine
        self.label = label
        self.step = 0
        self.requests: dict[str, Any] = {}
        self.num_preempted = 0
        self.max_scheduled = 0
        self.max_tokens_in_step = 0
        sched = engine.scheduler
        orig_schedule, orig_add = sched.schedule, sched.add_request

        def schedule():
            out = orig_schedule()
            self.check(out)
            return out

        def add_request(request):
            self.requests[request.request_id] = request
            return orig_add(request)

        sched.schedule = schedule
        sched.add_request = add_request

    def fail(self, msg: str) -> None:
        raise AssertionError(f"{self.label} step {self.step}: {msg}")

    def check(self, out) -> None:
        eng = self.engine
        cfg = eng.config.scheduler
        alloc = eng.allocator
        bs = alloc.block_size
        ids = [r.request_id for r in out.scheduled]
        if len(set(ids)) != len(ids):
            self.fail(f"a request is scheduled twice in one step: {ids}")
        if len(ids) > cfg.max_num_seqs:
            self.fail(f"{len(ids)} requests scheduled, max_num_seqs is {cfg.max_num_seqs}")
        total = sum(out.num_scheduled_tokens.get(i, 0) for i in ids)
        if total > cfg.max_num_batched_tokens:
            self.fail(f"{total} tokens scheduled, max_num_batched_tokens is {cfg.max_num_batched_tokens} "
                      f"({ {i: out.num_scheduled_tokens.get(i) for i in ids} })")
        if set(out.num_scheduled_tokens) != set(ids):
            self.fail(f"num_scheduled_tokens keys {sorted(out.num_scheduled_tokens)} != scheduled {sorted(ids)}")
        spec = getattr(out, "spec_token_ids", None) or {}
        for r in out.scheduled:
            n = out.num_scheduled_tokens[r.request_id]
            drafts = len(spec.get(r.request_id, ()))
            if r.is_finished:
                self.fail(f"finished request {r.request_id} ({r.status}) was scheduled")
            if not isinstance(n, int) or n < 1:
                self.fail(f"request {r.request_id} scheduled with {n!r} tokens (must be >= 1)")
            if r.num_computed_tokens + n > r.num_tokens + drafts:
                self.fail(f"request {r.request_id}: num_computed_tokens {r.num_computed_tokens} + {n} "
                          f"exceeds its {r.num_tokens} tokens (+ {drafts} draft tokens)")
            have = len(alloc.get_block_table(r.request_id)) * bs
            if have < r.num_computed_tokens + n:
                self.fail(f"request {r.request_id} runs tokens up to {r.num_computed_tokens + n} but holds "
                          f"blocks for only {have} (the scheduler must call allocate_slots first)")
        for r in out.preempted:
            if r.request_id in ids:
                self.fail(f"request {r.request_id} is both preempted and scheduled")
            if alloc.get_block_table(r.request_id):
                self.fail(f"preempted request {r.request_id} still holds blocks "
                          f"{alloc.get_block_table(r.request_id)}")
        self.num_preempted += len(out.preempted)
        self.max_scheduled = max(self.max_scheduled, len(ids))
        self.max_tokens_in_step = max(self.max_tokens_in_step, total)
        check_block_accounting(alloc, self.requests.values(), self.fail)

    def drain(self, arrivals: dict[int, list[tuple]] | None = None, aborts: dict[int, list[str]] | None = None,
              max_steps: int = 20_000, on_step: Callable | None = None) -> dict[str, "RequestOutput"]:
        """Step until every request finished. ``arrivals[k]``: ``(request_id, prompt,
        params)`` tuples added before the k-th step of this call; ``aborts[k]``: request
        ids aborted before it. Returns request_id -> final output; records ``added_at`` / ``finished_at``."""
        arrivals = dict(arrivals or {})
        aborts = dict(aborts or {})
        self.added_at: dict[str, int] = getattr(self, "added_at", {})
        self.finished_at: dict[str, int] = getattr(self, "finished_at", {})
        done: dict[str, RequestOutput] = {}
        eng = self.engine
        start = self.step
        while eng.has_unfinished_requests() or arrivals:
            k = self.step - start
            for rid, prompt, params in arrivals.pop(k, []):
                eng.add_request(rid, prompt, params)
                self.added_at[rid] = self.step
            for rid in aborts.pop(k, []):
                eng.abort_request(rid)
            for o in eng.step():
                if o.finished:
                    if o.request_id in done:
                        self.fail(f"request {o.request_id} finished twice")
                    done[o.request_id] = o
                    self.finished_at[o.request_id] = self.step
            if on_step is not None:
                on_step(self)
            self.step += 1
            if self.step > max_steps:
                self.fail(f"engine did not drain within {max_steps} steps "
                          f"({eng.get_num_unfinished_requests()} requests unfinished: a request starves)")
        return done


def check_block_accounting(alloc, requests: Iterable[Any], fail: Callable[[str], None]) -> None:
    """Block ids in range, finished requests hold nothing, and
    ``num_free_blocks == num_blocks - |union of tables|``; if the allocator has
    ``ref_count(block_id)``, it equals the number of tables holding the block."""
    holders: dict[int, int] = {}
    for r in requests:
        table = alloc.get_block_table(r.request_id)
        if not table:
            continue
        if r.is_finished:
            fail(f"finished request {r.request_id} ({r.status.value}) still holds blocks {table}: a finished "
                 f"request's blocks must be freed (allocator.free), also when it ends by abort or stop string "
                 f"(Scheduler.finish_requests)")
        if len(set(table)) != len(table):
            fail(f"request {r.request_id}'s block table repeats a block: {table}")
        for b in table:
            if not 0 <= b < alloc.num_blocks:
                fail(f"request {r.request_id} holds block id {b} outside [0, {alloc.num_blocks})")
            holders[b] = holders.get(b, 0) + 1
    expect = alloc.num_blocks - len(holders)
    if alloc.num_free_blocks != expect:
        fail(f"num_free_blocks is {alloc.num_free_blocks} but {len(holders)} of {alloc.num_blocks} blocks are "
             f"held by live requests (expected {expect} free): blocks leaked or handed out twice")
    ref_count = getattr(alloc, "ref_count", None)
    if callable(ref_count):
        for b, n in holders.items():
            if ref_count(b) != n:
                fail(f"ref_count({b}) is {ref_count(b)} but {n} live block tables hold it")


def assert_drained(engine: "LLMEngine", label: str) -> None:
    """No unfinished request, and every KV block is back."""
    if engine.has_unfinished_requests():
        raise AssertionError(f"{label}: engine still has unfinished requests")
    a = engine.allocator
    if a.num_free_blocks != a.num_blocks:
        raise AssertionError(f"{label}: KV blocks leaked: {a.num_blocks - a.num_free_blocks} of {a.num_blocks} "
                             f"still allocated after every request finished")


# -- workloads and reference outputs -----------------------------------------------------------

def random_prompts(rng: random.Random, n: int, min_len: int, max_len: int, vocab: int = 512,
                   shared_prefix: int = 0, share_every: int = 2) -> list[list[int]]:
    """``n`` prompts of token ids (BOS = 1 first) with lengths in ``[min_len, max_len]``;
    every ``share_every``-th one starts with a common ``shared_prefix``-token prefix."""
    common = [1] + [rng.randrange(3, vocab) for _ in range(max(0, shared_prefix - 1))]
    out = []
    for i in range(n):
        length = rng.randint(min_len, max_len)
        if shared_prefix and i % share_every == 0 and length > shared_prefix:
            p = common + [rng.randrange(3, vocab) for _ in range(length - shared_prefix)]
        else:
            p = [1] + [rng.randrange(3, vocab) for _ in range(length - 1)]
        out.append(p)
    return out


_REFERENCE_CACHE: dict[tuple, dict[str, list[int]]] = {}


def reference_engine(target: Target, longest: int, num_requests: int) -> "LLMEngine":
    """An engine in the reference configuration: scheduler ``fcfs``, allocator ``paged``
    without prefix caching, attention ``torch_ref``, room for ``num_requests`` requests of up
    to ``longest`` tokens (prompt + output) in one step."""
    return target.engine(scheduler="fcfs", kv_allocator="paged", attention_backend="torch_ref",
                         enable_prefix_caching=False, max_num_batched_tokens=max(2048, longest),
                         max_num_seqs=max(1, num_requests))


def reference_outputs(target: Target, prompts: list[list[int]], max_tokens: int,
                      ignore_eos: bool = False) -> list[list[int]]:
    """Greedy token ids from the reference configuration: scheduler ``fcfs``, allocator
    ``paged`` without prefix caching, attention ``torch_ref``, blocks and budget to spare."""
    key = (target.model, target.device, tuple(map(tuple, prompts)), max_tokens, ignore_eos)
    if key not in _REFERENCE_CACHE:
        from kvforge import SamplingParams
        eng = reference_engine(target, max(len(p) for p in prompts) + max_tokens, len(prompts))
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        mon = StepMonitor(eng, "reference fcfs")
        done = mon.drain({0: [(f"ref{i}", {"prompt_token_ids": p}, sp) for i, p in enumerate(prompts)]})
        _REFERENCE_CACHE[key] = {rid: o.outputs[0].token_ids for rid, o in done.items()}
    ref = _REFERENCE_CACHE[key]
    return [ref[f"ref{i}"] for i in range(len(prompts))]


def compare_outputs(got: dict[str, "RequestOutput"], ids: list[str], ref: list[list[int]], tag: str,
                    what: str) -> None:
    """Assert ``got[ids[i]]`` finished normally with exactly ``ref[i]``'s tokens."""
    for rid, want in zip(ids, ref):
        o = got.get(rid)
        if o is None:
            raise AssertionError(f"{tag}: request {rid} never finished")
        c = o.outputs[0]
        if c.finish_reason not in ("stop", "length"):
            raise AssertionError(f"{tag}: request {rid} finished with {c.finish_reason!r} ({o.error}), "
                                 f"expected a normal finish")
        if c.token_ids != want:
            i = next((k for k, (a, b) in enumerate(zip(c.token_ids, want)) if a != b),
                     min(len(c.token_ids), len(want)))
            raise AssertionError(f"{tag}: {what}: request {rid} differs from the reference at output index {i}: "
                                 f"got {c.token_ids[max(0, i - 2):i + 6]}, reference {want[max(0, i - 2):i + 6]}")
