"""LLMEngine: the step loop (schedule -> allocate -> forward -> sample -> update)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from kvforge.config import EngineConfig
from kvforge.engine.builder import EngineParts, build_engine_parts
from kvforge.engine.capabilities import describe
from kvforge.engine.output_processor import OutputProcessor
from kvforge.engine.outputs import RequestOutput
from kvforge.engine.profiling import TraceProfiler, resolve_dir, span
from kvforge.engine.request import Request, RequestStatus, apply_stop_string, drop_placeholders
from kvforge.engine.request_choices import validate_request_choices
from kvforge.engine.sampler import Sampler, compute_prompt_logprobs
from kvforge.engine.sampling_params import SamplingParams
from kvforge.engine.schedule_check import checked_schedule, checked_update
from kvforge.engine.request_params import finalize_params
from kvforge.engine.structured_outputs import GrammarCompiler
from kvforge.engine.tokenizer import check_text, eos_token_ids, extra_eos_token_ids, load_tokenizer
from kvforge.interfaces import SchedulerOutput
from kvforge.plugin_manager import Registry, load_registry

log = logging.getLogger("kvforge")

@dataclass
class PreparedRequest:
    """A validated request, ready for :meth:`LLMEngine.enqueue`."""

    request_id: str
    prompt: str | None
    children: list[Request]


#: A prompt: text, a list of token ids, or ``{"prompt_token_ids": [...]}`` / ``{"prompt": "..."}``.
PromptType = Any


#: Keys of a dict prompt (vLLM's TextPrompt / TokensPrompt, and the prefix cache's salt).
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})


class LLMEngine:
    """Continuous-batching engine over plugin-supplied parts.

    Build with ``LLMEngine(EngineConfig)``; plugin hooks run once, here.
    Not thread-safe: one caller drives ``add_request``/``step``.
    """

    def __init__(self, config: EngineConfig, registry: Registry | None = None) -> None:
        config = config.model_copy(deep=True)
        self.registry = registry if registry is not None else load_registry()
        parts: EngineParts = build_engine_parts(config, self.registry)
        self.parts = parts
        self.config = parts.config
        self.scheduler = parts.scheduler
        self._scheduler_who = describe(self.registry.get("scheduler", config.scheduler.name))
        self.allocator = parts.allocator
        self.max_model_len = parts.max_model_len
        self.vocab_size = parts.hf_config.vocab_size
        self.tokenizer = load_tokenizer(config.model.tokenizer or config.model.model)
        if len(self.tokenizer) > self.vocab_size:  # (fewer is common: embedding tables are padded)
            log.warning("model.tokenizer: %s has %d tokens but the model's vocab_size is %d, so any text that "
                        "encodes to an id >= %d is refused: is it the model's tokenizer?",
                        config.model.tokenizer or config.model.model, len(self.tokenizer), self.vocab_size,
                        self.vocab_size)
        self.eos_token_ids = eos_token_ids(self.tokenizer, config.model.model)
        self.extra_eos_token_ids = extra_eos_token_ids(self.tokenizer, self.eos_token_ids)
        from kvforge.engine.executor import create_executor
        self.executor = create_executor(parts)  # in-process ModelRunner (+ CUDA graphs), or the workers' proxy
        self.runner = self.executor.runner
        gen = torch.Generator(device=parts.device).manual_seed(config.model.seed)
        self.sampler = Sampler(self.vocab_size, gen)
        self.spec = None  # SpeculativeDecoder when any drafter is configured
        if parts.drafters:
            from kvforge.engine.spec_decode import SpeculativeDecoder
            needs_hidden = [n for n in parts.drafters
                            if self.registry.get("drafter", n).capabilities.get("needs_hidden_states")]
            self.runner.return_hidden_states = bool(needs_hidden)
            self.spec = SpeculativeDecoder(parts.drafters, self.config.speculative.method, self.config.speculative,
                                           self.vocab_size, gen, self.max_model_len, needs_hidden)
        self.outputs = OutputProcessor(self.tokenizer)
        self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)  # (xgrammar on first use)
        self._live: dict[str, Request] = {}  # child request_id -> request
        self._pending: list[RequestOutput] = []
        # Live requests whose sampling reads their generated token ids (penalties): while
        # any is live, async scheduling waits for each step's tokens before the next.
        self._needs_history: set[str] = set()
        self._overlap = None
        self._profiler = TraceProfiler()  # this process's part of start_profile
        if self.config.scheduler.async_scheduling:
            from kvforge.engine.overlap import OverlapStepper
            self._overlap = OverlapStepper(self)

    @classmethod
    def from_kwargs(cls, model: str, config_file: str | None = None, **kwargs: Any) -> "LLMEngine":
        """``LLMEngine.from_kwargs("dir", max_num_seqs=4, scheduler="fcfs")``: flat vLLM-style options."""
        return cls(EngineConfig.from_sources(config_file, {"model": model, **kwargs}))

    # -- requests -------------------------------------------------------------------------
    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            unknown = sorted(map(str, set(prompt) - _PROMPT_KEYS))
            if unknown:  # (a misspelt key would silently drop what it meant)
                raise ValueError(f"prompt: unknown key(s) {unknown} in a dict prompt; known: "
                                 f"{', '.join(sorted(_PROMPT_KEYS))}")
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                text = prompt.get("prompt")
            elif "prompt" in prompt:
                if not isinstance(prompt["prompt"], str):
                    raise ValueError(f"prompt: the 'prompt' of a dict prompt must be a string, got "
                                     f"{type(prompt['prompt']).__name__}")
                return self._prompt_ids(prompt["prompt"])
            else:
                raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        else:
            ids, text = prompt, None
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            if not isinstance(prompt, (dict, list, tuple)):  # neither text, nor ids, nor a dict
                raise ValueError(f"prompt: expected a string, a list of token ids or a dict, got "
                                 f"{type(prompt).__name__}")
            raise ValueError("prompt_token_ids: must be a list of ints")
        return text, list(ids)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None) -> None:
        """Validate and queue one request. Nothing changes unless validation passes.

        Raises:
            ValueError: naming the field: duplicate request_id, empty prompt, token ids
                outside the vocabulary, a prompt that leaves no room to generate within
                max_model_len, bad logit_bias, and the checks of
                :func:`~kvforge.engine.request_params.finalize_params`. (A max_tokens beyond the room left is not an
                error: generation stops at max_model_len, finish_reason "length", as in vLLM.)
        """
        self.enqueue(self.prepare_request(request_id, prompt, params, priority, arrival_time))

    def prepare_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                        priority: int = 0, arrival_time: float | None = None) -> "PreparedRequest":
        """Validate a request and build its sequences without touching engine state
        (so a batch can be validated whole before any of it is queued).

        Raises:
            ValueError: as :meth:`add_request`.
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        # The request keeps its own copy (fresh stop / stop_token_ids / logit_bias containers;
        # extra_args shared): a caller may change and reuse its object for later requests,
        # and the workers that sample cache params by object (worker_sampling.ParamsTable).
        # Copying re-runs the checks, so an object changed after construction is refused here,
        # before the checks below read its fields.
        params = params.clone()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id: must be a non-empty string")
        if request_id in self.outputs.parents:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        if isinstance(prompt, str) and not prompt:
            raise ValueError("prompt: must not be empty")
        text, ids = self._prompt_ids(prompt)
        if not ids:
            raise ValueError("prompt: must not be empty (it encodes to zero tokens)")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids: ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        ids = finalize_params(params, ids, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                              max_logprobs=self.config.model.max_logprobs, tokenizer=self.tokenizer,
                              eos_token_ids=self.eos_token_ids)
        validate_request_choices(self.config, self.registry, params, priority)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room to generate within max_model_len "
                             f"({self.max_model_len})")
        why = self.scheduler.admission_error(len(ids))
        if why:
            raise ValueError(f"prompt: {why} (scheduler {self.config.scheduler.name!r})")
        # As vLLM's engine: more max_tokens than the room left stops at max_model_len with
        # finish_reason "length" (the OpenAI server refuses such a request up front, 400).
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and not isinstance(salt, str):
            raise ValueError("cache_salt: must be a string")
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        compiled = self._grammars.compile(params.structured_outputs) if params.structured_outputs else None
        children = []
        for i in range(params.n):
            cid = request_id if params.n == 1 else f"{request_id}#{i}"
            if cid in self._live:
                raise ValueError(f"request_id: {request_id!r} collides with an in-flight request")
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.parts.device).manual_seed(params.seed + i)
            children.append(Request(cid, list(ids), params, max_tokens, self.eos_token_ids,
                                    self.extra_eos_token_ids, parent_id=request_id, index=i, priority=priority,
                                    arrival_time=arrival + i * 1e-9, generator=gen, cache_salt=salt,
                                    grammar=self._grammars.matcher(compiled) if compiled is not None else None))
        return PreparedRequest(request_id, text, children)

    def enqueue(self, prepared: "PreparedRequest") -> None:
        """Queue a request built by :meth:`prepare_request`."""
        if prepared.request_id in self.outputs.parents:
            raise ValueError(f"request_id: {prepared.request_id!r} is already in flight")
        self.outputs.add(prepared.request_id, prepared.prompt, prepared.children)
        for c in prepared.children:
            self._live[c.request_id] = c
            if c.sampling_params.reads_history:
                self._needs_history.add(c.request_id)
            self.scheduler.add_request(c)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests by user id; their blocks return to the allocator now.
        Their final outputs (finish_reason ``abort``) come from the next ``step()``."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            parent = self.outputs.parents.get(rid)
            if parent is None:
                continue
            aborted = self.scheduler.finish_requests([c.request.request_id for c in parent.children],
                                                     RequestStatus.FINISHED_ABORTED)
            for req in aborted:  # a token still being sampled for it is dropped, not reported
                drop_placeholders(req)
            if self.spec is not None:
                for c in parent.children:
                    self.spec.free(c.request)
            if aborted:
                self._pending.append(self._emit(rid))
            # else every sequence had already finished (async scheduling: its last token is
            # still on its way); the next step reports it, exactly as without the abort

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.parents) or bool(self._pending)

    # -- profiling ----------------------------------------------------------------------
    def start_profile(self, out_dir: str | None = None) -> None:
        """Start torch.profiler in this process and in every worker (vLLM's ``start_profile``).

        ``out_dir`` (default ``$KVFORGE_TORCH_PROFILER_DIR``) receives, at :meth:`stop_profile`,
        one Chrome trace per process: ``driver.json``, and ``rank{R}.json`` per worker. A step
        still in flight (async scheduling) is finished first; its outputs come with the next
        ``step()``.

        Raises:
            ValueError: no directory given or set, or it cannot be created.
            RuntimeError: already profiling, or a worker could not start its profiler
                (the engine keeps serving either way).
        """
        out_dir = resolve_dir(out_dir)  # absolute and created here: workers may run elsewhere
        if self._overlap is not None:
            self._overlap.drain()  # worker calls wait for no step in flight
        self._profiler.start(out_dir, "driver")  # (raises if already running)
        try:
            self.executor.start_profile(out_dir)
        except BaseException:
            self._profiler.stop()  # nothing half-started stays behind
            raise

    def stop_profile(self) -> list[str]:
        """Stop every profiler started by :meth:`start_profile`; returns the trace files
        written (driver first). Does nothing when none runs."""
        if not self._profiler.active:
            return []
        if self._overlap is not None:
            self._overlap.drain()
        return [self._profiler.stop()] + self.executor.stop_profile()

    def get_num_unfinished_requests(self) -> int:
        return len(self.outputs.parents)

    # -- the step -------------------------------------------------------------------------
    def schedule(self) -> "SchedulerOutput":
        """The scheduler's next step, its errors and limits attributed to the plugin
        (:func:`kvforge.engine.schedule_check.checked_schedule`)."""
        sc = self.config.scheduler
        return checked_schedule(self.scheduler, self._scheduler_who, sc.max_num_seqs, sc.max_num_batched_tokens,
                                self.outputs.parents)

    def step(self) -> list[RequestOutput]:
        """One engine iteration. Returns outputs of requests that changed (new tokens or finished).

        With ``scheduler.async_scheduling`` the outputs of a step are returned by the next
        call (see :mod:`kvforge.engine.overlap`); the tokens are the same."""
        groups = None
        if self.spec is not None:  # drafts are made before scheduling, so it reserves their slots
            groups = self.spec.plan(self._live.values(), self.allocator.num_free_blocks)
        if self._overlap is not None:
            if not groups:
                return self._overlap.step()
            self._overlap.drain()  # a verify step needs the real last tokens: run it synchronously
        if groups:
            self.spec.propose(groups)
        results = self._pending
        self._pending = []
        with span("kvforge.schedule"):  # phase ranges for start_profile traces
            so = self.schedule()
        touched: dict[str, None] = {}
        for req in so.finished:
            touched[req.parent_id] = None
        sampled: dict[str, list[int]] = {}
        # request_id -> (tokens, per-token logprobs dicts or None, per-token raw logprobs)
        new: dict[str, tuple[list[int], list, list[float]]] = {}
        sample_reqs: list[Request] = []
        if self.spec is not None:
            for req in so.preempted:  # its drafter state restarts from scratch
                self.spec.free(req)
        if not so.scheduled and (so.swap_out or so.swap_in):
            self.runner.swap(so.swap_out, to_cpu=True)
        if so.scheduled:
            try:
                with span("kvforge.execute"):
                    ex = self.runner.execute(so)
                self._record_prompt_logprobs(ex)
                if ex.sample_requests:
                    sample_reqs = ex.sample_requests
                    if self.spec is not None:
                        new = self.spec.sample(ex, so, self.sampler)
                    else:
                        with span("kvforge.sample"):
                            sout = self.sampler(ex.logits, ex.sample_requests)
                        for i, req in enumerate(ex.sample_requests):
                            new[req.request_id] = ([sout.sampled_token_ids[i]], [sout.logprobs[i]],
                                                   [sout.sampled_logprobs[i]])
                    sampled = {rid: v[0] for rid, v in new.items()}
            except Exception as e:  # a failure fails this step's requests only; the engine stays up
                self._fail_step(so, e, touched)
                sampled = {}
                new = {}
                sample_reqs = []
        before = {req.request_id: req.num_output_tokens for req in sample_reqs}
        checked_update(self.scheduler, self._scheduler_who, so, sampled)
        for req in sample_reqs:
            touched[req.parent_id] = None
            # Tokens the scheduler kept (an EOS / stop id / max_tokens inside an accepted
            # block cuts there); the detokenizer may cut earlier at a stop string.
            kept = req.num_output_tokens - before[req.request_id]
            if kept <= 0:
                continue
            _, lps, slps = new[req.request_id]
            stop = self.outputs.process_tokens(req, kept, lps[:kept], slps[:kept])
            if stop is not None:
                apply_stop_string(self.scheduler, req, stop)
        self._emit_touched(touched, results)
        return results

    def _record_prompt_logprobs(self, ex) -> None:
        for rid, (first, logits) in ex.prompt_logits.items():
            req = self._live[rid]
            targets = req.prompt_token_ids[first:first + logits.shape[0]]
            entries = compute_prompt_logprobs(logits, targets, req.sampling_params.prompt_logprobs)
            self.outputs.add_prompt_logprobs(req, first, entries)

    def _fail_step(self, so, err: Exception, touched: dict[str, None]) -> None:
        """A failed forward fails this step's requests only; the engine stays up."""
        log.exception("engine step failed")
        failed = self.scheduler.finish_requests([r.request_id for r in so.scheduled], RequestStatus.FINISHED_ERROR)
        for r in failed:
            r.error = f"engine error: {type(err).__name__}: {err}"
            touched[r.parent_id] = None
        so.scheduled = []

    def _emit_touched(self, touched: dict[str, None], results: list[RequestOutput]) -> None:
        """Emit an output per touched user request (FINAL_ONLY ones once finished); forget
        finished sequences."""
        for pid in touched:
            if pid in self.outputs.parents and self.outputs.wants_output(pid):
                results.append(self._emit(pid))
        for req in list(self._live.values()):
            if req.is_finished:
                del self._live[req.request_id]
                self._needs_history.discard(req.request_id)
                if self.spec is not None:
                    self.spec.free(req)

    def _emit(self, parent_id: str) -> RequestOutput:
        out = self.outputs.make_output(parent_id)
        if self.spec is not None and out.finished:  # per-request speculation metrics: final output only
            parent = self.outputs.parents[parent_id]
            out.metrics.update(self.spec.request_metrics(c.request for c in parent.children))
        self.outputs.release_if_finished(parent_id)
        return out

    def stats(self) -> dict[str, float]:
        out = {**self.scheduler.stats(), **self.allocator.stats()}
        if self.spec is not None:
            out.update(self.spec.stats())
        return out
