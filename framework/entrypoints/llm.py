"""Offline batch API, shaped like vLLM's ``LLM``."""
from __future__ import annotations

import itertools
import numbers
import threading
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from tqdm.auto import tqdm

from kvforge.config import EngineConfig
from kvforge.engine.llm_engine import PromptType
from kvforge.engine.outputs import RequestOutput
from kvforge.engine.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from kvforge.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams


class LLM:
    """``LLM(model="dir", dtype="float32", max_num_seqs=8, scheduler="fcfs", ...)``.

    Keyword arguments are the flat config fields (see ``kvforge.config.FLAT_FIELDS``:
    ``dtype``, ``max_model_len``, ``block_size``, ``num_gpu_blocks``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``seed``, ``scheduler``, ``attention_backend``,
    ``kv_allocator``, ``quantization``, ...) or dotted paths (``scheduler.settings.x``);
    ``config`` may name a YAML/JSON file that they override.

    Raises:
        ValueError / pydantic.ValidationError: naming the bad field.
    """

    def __init__(self, model: str | None = None, config: str | None = None, **kwargs: Any) -> None:
        if model is not None:
            kwargs["model.model"] = model
        from pydantic import ValidationError

        from kvforge.config import config_error_message
        from kvforge.engine.executor import create_engine  # LLMEngine, or data-parallel replicas
        try:
            cfg = EngineConfig.from_sources(config, kwargs)
        except ValidationError as e:  # one line per field, as from the command line
            raise ValueError(config_error_message(e)) from None
        self.llm_engine = create_engine(cfg)
        self._counter = itertools.count()
        # one generate() drives the engine at a time: two threads stepping one engine would
        # take each other's outputs (another thread's call waits its turn)
        self._busy = threading.Lock()

    def start_profile(self, out_dir: str | None = None) -> None:
        """Start torch.profiler in the engine's processes (see ``LLMEngine.start_profile``;
        with data parallelism each replica writes to ``<out_dir>/replica{i}/``); traces go to
        ``out_dir`` or ``$KVFORGE_TORCH_PROFILER_DIR``."""
        self.llm_engine.start_profile(out_dir)

    def stop_profile(self) -> list[str]:
        """Stop profiling; returns the Chrome trace files written."""
        return self.llm_engine.stop_profile()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def chat(self, messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a batch of them (as vLLM's ``LLM.chat``);
        returns one finished RequestOutput per conversation, in order.

        ``messages``: a conversation (a list of ``{"role", "content"}`` dicts; ``content`` a
        string or a list of ``{"type": "text", "text": ...}`` parts, joined with newlines) or a
        list of conversations. Each is rendered with ``chat_template`` (default: the
        tokenizer's) exactly as ``/v1/chat/completions`` renders it, and encoded without the
        tokenizer's special tokens (the template writes BOS itself). ``sampling_params``: one for
        all, or one per conversation. ``continue_final_message`` extends the last (assistant)
        message instead of starting a new one; it needs ``add_generation_prompt=False``.
        ``chat_template_kwargs``: extra template variables (as the server's field); ``tools``:
        tool definitions passed to the template as ``tools`` (rendered only: no tool-call parsing).

        Raises:
            ValueError: a bad message (``messages[i]...`` or ``messages[c][i]...`` in a batch),
                no chat template, a template that fails, or a bad sampling parameter (nothing
                is queued then).
        """
        from kvforge.entrypoints.openai import chat_utils  # no web stack: pydantic + jinja only
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message: cannot be combined with add_generation_prompt=True")
        tokenizer = self.get_tokenizer()
        template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
        if not template:
            raise ValueError("chat_template: the model's tokenizer has no chat template; pass chat_template=...")
        batched = (isinstance(messages, Sequence) and not isinstance(messages, (str, bytes)) and len(messages) > 0
                   and all(isinstance(c, Sequence) and not isinstance(c, (str, bytes, dict)) for c in messages))
        conversations = list(messages) if batched else [messages]
        prompts: list[PromptType] = []
        for i, conv in enumerate(conversations):
            where = f"messages[{i}]" if batched else "messages"
            try:
                text = chat_utils.render_chat(tokenizer, chat_utils.parse_messages(conv, where), template,
                                              add_generation_prompt=add_generation_prompt,
                                              continue_final_message=continue_final_message, tools=tools,
                                              template_kwargs=chat_template_kwargs)
            except chat_utils.ChatTemplateError as e:
                msg = str(e)
                if batched:  # name the conversation: "messages: ..." -> "messages[i]: ..."
                    msg = where + msg[len("messages"):] if msg.startswith("messages") else f"{where}: {msg}"
                raise ValueError(msg) from e
            prompts.append({"prompt": text, "prompt_token_ids": chat_utils.encode_chat_prompt(tokenizer, text)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: "BeamSearchParams",
                    use_tqdm: bool = False) -> list["BeamSearchOutput"]:
        """Beam search (as vLLM's ``LLM.beam_search``); one :class:`BeamSearchOutput` per prompt,
        in order, its ``beam_width`` sequences best first (:mod:`kvforge.entrypoints.beam_search`).

        Each step runs every live beam as a one-token request asking K = max(2, 1 + EOS ids) *
        beam_width log-probabilities, so ``model.max_logprobs`` must allow K; turn prefix caching
        on (``enable_prefix_caching=True``) so that steps reuse the beams' KV blocks. No prompts:
        no outputs.

        Raises:
            ValueError: a bad prompt, ``params`` not a BeamSearchParams, or a beam_width whose K
                exceeds ``model.max_logprobs`` (nothing runs then).
        """
        from kvforge.entrypoints.beam_search import run_offline
        return run_offline(self, prompts, params, use_tqdm)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; returns one finished RequestOutput per prompt, in order.

        ``prompts``: a string, a ``{"prompt_token_ids": [...]}`` dict, or a list of them.
        ``sampling_params``: one for all, or one per prompt (default: ``SamplingParams()``).

        Thread-safe: calls from several threads run one after another. As in vLLM, each
        request runs with ``output_kind`` FINAL_ONLY (on a copy of its params): only final
        outputs are built.

        Raises:
            ValueError: bad prompt or params (nothing is queued then).
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
            raise ValueError(f"prompts: expected a string, a {{'prompt_token_ids': [...]}} dict or a list of "
                             f"them, got {type(prompts).__name__}")
        prompts = list(prompts)
        if prompts and all(isinstance(p, numbers.Integral) and not isinstance(p, bool) for p in prompts):
            raise ValueError("prompts: a list of integers would be that many one-token prompts; pass token ids "
                             "as {'prompt_token_ids': [...]} (or a list of such dicts)")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (dict, str)) or not isinstance(sampling_params, Sequence):
            raise ValueError(f"sampling_params: expected SamplingParams or a list of them, "
                             f"got {type(sampling_params).__name__}")
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        final: dict[int, SamplingParams] = {}  # one copy per distinct params object
        for i, sp in enumerate(params):
            if isinstance(sp, SamplingParams) and sp.output_kind != RequestOutputKind.FINAL_ONLY:
                if id(sp) not in final:
                    try:  # (the copy re-runs the checks, as prepare_request's own copy would)
                        final[id(sp)] = sp.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                    except ValueError as e:
                        raise ValueError(f"prompts[{i}]: {e}" if len(prompts) > 1 else str(e)) from None
                params[i] = final[id(sp)]
        prios = list(priority) if priority is not None else [0] * len(prompts)
        if len(prios) != len(prompts):
            raise ValueError(f"priority: got {len(prios)} values for {len(prompts)} prompts")
        with self._busy:
            return self._generate(prompts, params, prios, use_tqdm)

    def _generate(self, prompts: list, params: list, prios: list, use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = [f"llm-{next(self._counter)}" for _ in prompts]
        # Validate the whole batch first: a bad prompt queues nothing.
        prepared = []
        for i, (rid, prompt, sp, pr) in enumerate(zip(ids, prompts, params, prios)):
            try:
                prepared.append(engine.prepare_request(rid, prompt, sp, priority=pr))
            except ValueError as e:
                if len(prompts) == 1:
                    raise
                raise ValueError(f"prompts[{i}]: {e}") from None
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        pending = set(ids)
        try:
            for p in prepared:
                engine.enqueue(p)
            while pending:
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        finished[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
        except BaseException:  # (KeyboardInterrupt too) this call's requests must not linger in the engine
            engine.abort_request([i for i in ids if i in pending])
            raise
        finally:
            bar.close()
        return [finished[i] for i in ids]
