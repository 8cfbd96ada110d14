"""A worker: one rank of one engine replica. Holds its model shard and its KV caches and
runs the forward of every step the driver sends (transport-agnostic: the mp and Ray
executors both drive this class).

Life cycle: ``Worker(...)`` -> :meth:`load_model` (joins the process groups, builds the
model, reports how many KV blocks fit) -> :meth:`init_cache` (the driver's block count;
captures CUDA graphs) -> :meth:`execute` per step -> :meth:`shutdown`.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any

import numpy as np
import torch
import transformers.configuration_utils  # noqa: F401 - heavy lazy imports, done once by a forkserver
import transformers.models.auto.configuration_auto  # noqa: F401
import transformers.utils.type_validators  # noqa: F401 - (what every model config module imports)
from transformers import AutoConfig

from kvforge.distributed import parallel_state as ps
from kvforge.distributed.communication import pp_isend, pp_recv
from kvforge.engine.profiling import TraceProfiler, span
from kvforge.distributed.protocol import StepMessage, build_micro_batches

log = logging.getLogger("kvforge.worker")


class SampledStep:
    """The output rank's result of a step sampled on the worker: the tokens (and logprobs)
    on their way to the host. The mp transport's reply thread
    (:class:`~kvforge.distributed.reply_sender.ReplySender`) sends :meth:`finalize`, so
    the main loop goes on to the next step meanwhile."""

    def __init__(self, pending, error: str | None) -> None:
        self.pending = pending
        self.error = error

    def finalize(self) -> tuple:
        """``("sampled", SamplerOutput)`` or ``("sample_error", message)``; waits for the copy
        (callable from any thread)."""
        if self.error is not None:
            return ("sample_error", self.error)
        dev = self.pending.token_ids.device
        # the caller's thread may have another current device
        with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
            return ("sampled", self.pending.result())


class Worker:
    """Rank ``rank`` of a ``world_size``-rank replica.

    Args:
        config: the engine's :class:`~kvforge.config.EngineConfig` as a dict (``EngineConfig.to_transfer()``).
        max_model_len: resolved by the driver.
        device_index: the local CUDA device of this rank (ignored on CPU).
        init_method: ``tcp://host:port`` rendezvous of the replica's process group.
    """

    def __init__(self, rank: int, world_size: int, config: dict, max_model_len: int, device_index: int,
                 init_method: str) -> None:
        from kvforge.config import EngineConfig
        self.rank = rank
        self.world_size = world_size
        self.config = EngineConfig.model_validate(config)
        self.max_model_len = max_model_len
        self.device_index = device_index
        self.init_method = init_method
        self.graphs = None
        self.calibrating = False  # cache.calculate_kv_scales: the next forward runs eagerly
        self.out_buf: torch.Tensor | None = None
        self._slot = 0  # out_buf slot of the next step (two alternate: the driver may still read one)
        # Set by a transport that delivers a step's placeholder tokens apart from the step
        # (mp): returns the previous step's sampled tokens (int64 numpy).
        self.receive_tokens = None
        self.profiler = TraceProfiler()
        self.sampler = None  # WorkerSampler on the output rank (parallel.sample_on_worker)
        self.prev_tokens: torch.Tensor | None = None  # int64 [R] last worker-sampled step's tokens

    # -- build --------------------------------------------------------------------------
    def load_model(self) -> dict[str, Any]:
        """Join the process groups, build this rank's model shard and load its weights.

        Returns: ``num_blocks`` (KV blocks that fit here), ``block_bytes`` (bytes of one
        block on this rank), ``choices`` (plugins picked), ``is_output_rank``.
        """
        from kvforge.engine.builder import build_model_stack, resolve_device, resolve_dtype
        from kvforge.engine.sizing import num_kv_blocks
        from kvforge.layers.attention import PagedAttention
        from kvforge.plugin_manager import load_registry

        cfg = self.config
        par = cfg.parallel
        device = resolve_device(cfg.model.device)
        if device.type == "cuda":
            device = torch.device("cuda", self.device_index)
        self.device = device
        self.state = ps.init_parallel_state(
            rank=self.rank, world_size=self.world_size, tp_size=par.tensor_parallel_size,
            pp_size=par.pipeline_parallel_size, init_method=self.init_method, device=device,
            expert_parallel=par.enable_expert_parallel, timeout_s=par.worker_timeout_s)
        registry = load_registry()
        hf_config = AutoConfig.from_pretrained(cfg.model.model, local_files_only=True)
        arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
        model_spec = registry.get("model", arch)
        if par.pipeline_parallel_size > 1 and not getattr(model_spec.factory, "supports_pipeline_parallel", False):
            raise ValueError(f"model {arch!r} ({model_spec.name}) does not support pipeline parallelism "
                             "(its class lacks supports_pipeline_parallel)")
        self.hf_config = hf_config
        self.dtype = resolve_dtype(cfg.model.dtype, hf_config)
        if self.state.tp_size > 1:  # collective: every rank of the TP group takes part
            from kvforge.distributed.symm_mem_allreduce import build
            self.state.fast_all_reduce = build(self.state.tp_group, device, self.dtype, par.all_reduce)
        stack = build_model_stack(registry, hf_config, model_spec, cfg.model.model, dtype=self.dtype, device=device,
                                  block_size=cfg.cache.block_size, attention=cfg.attention,
                                  quant_method=cfg.quantization.method, quant_settings=cfg.quantization.settings,
                                  load_format=cfg.model.load_format, seed=cfg.model.seed,
                                  kv_cache_dtype=cfg.cache.kv_cache_dtype,
                                  calculate_kv_scales=cfg.cache.calculate_kv_scales,
                                  quant_config_checked=True)  # (the driver's check logged its warnings)
        self.model, self.backend, self.stack = stack.model, stack.backend, stack
        if self.state.expert_parallel and not self.state.ep_asked:  # (it would only turn CUDA graphs off)
            raise ValueError(f"enable_expert_parallel: model {arch!r} ({model_spec.name}) has no layer that splits "
                             "its experts across ranks (not a mixture-of-experts model?); turn it off")
        self.attn_spec = stack.attn_spec
        # This rank's attention layers (a pipeline stage has only some) and their local KV heads.
        self.layers = {m.layer.layer_idx: m.layer for m in self.model.modules() if isinstance(m, PagedAttention)}
        elem = torch.empty((), dtype=stack.kv_dtype).element_size()
        bs = cfg.cache.block_size
        self.block_bytes = sum(2 * bs * L.num_kv_heads * L.head_size * elem for L in self.layers.values())
        num_blocks = num_kv_blocks(cfg, device, max(self.block_bytes, 1), self.max_model_len)
        st = self.state
        self.is_output_rank = st.is_last_stage and st.tp_rank == 0
        return {"num_blocks": num_blocks, "block_bytes": self.block_bytes, "is_output_rank": self.is_output_rank,
                "choices": {"attention": stack.attn_spec.name, "quantizer": stack.quant_spec.name},
                "device": str(device)}

    def init_cache(self, num_blocks: int, num_cpu_blocks: int, share_output: bool) -> Any:
        """Allocate the KV caches (``num_blocks`` + one scratch block), capture CUDA graphs.

        Returns: on the output rank with ``share_output``, the logits buffer the driver
        reads (shared once; CUDA IPC on GPU): float32 [2, max_num_seqs, V], two slots used
        in turn, so a step can write one while the driver still copies the previous
        step's logits out of the other (async scheduling); else None.
        """
        cfg = self.config
        bs = cfg.cache.block_size
        n_layers = self.hf_config.num_hidden_layers
        self.kv_caches, self.cpu_caches = [], []
        for i in range(n_layers):
            L = self.layers.get(i)
            if L is None:  # another pipeline stage's layer
                self.kv_caches.append(torch.empty(0, dtype=self.dtype, device=self.device))
                continue
            shape = self.backend.kv_cache_shape(num_blocks + 1, bs, L.num_kv_heads, L.head_size)
            self.kv_caches.append(torch.zeros(shape, dtype=self.stack.kv_dtype, device=self.device))
            if num_cpu_blocks:
                cshape = self.backend.kv_cache_shape(num_cpu_blocks, bs, L.num_kv_heads, L.head_size)
                self.cpu_caches.append(torch.zeros(cshape, dtype=self.stack.kv_dtype, device="cpu",
                                                   pin_memory=self.device.type == "cuda"))
        self.num_blocks = num_blocks
        par = cfg.parallel
        use_graphs = (self.device.type == "cuda" and not cfg.model.enforce_eager and par.pipeline_parallel_size == 1
                      and not self.state.expert_parallel and bool(self.attn_spec.capabilities.get("cuda_graphs"))
                      and getattr(self.model, "supports_cuda_graphs", True))
        if use_graphs:
            from kvforge.engine.cuda_graphs import CudaGraphRunner, decode_capture
            max_batch, sizes = decode_capture(cfg)
            self.graphs = CudaGraphRunner(self.model, self.backend, self.kv_caches, max_batch, self.max_model_len, bs,
                                          scratch_block=num_blocks, device=self.device, buckets=sizes)
            self.graphs.capture()
        if cfg.cache.calculate_kv_scales:  # the first real step sets the FP8 KV scales, eagerly
            from kvforge.layers.attention import arm_kv_scale_calibration
            self.calibrating = arm_kv_scale_calibration(self.model) > 0
        if self.is_output_rank and self.state.pp_size == 1:
            from kvforge.distributed.worker_sampling import WorkerSampler
            self.sampler = WorkerSampler(self.hf_config.vocab_size, self.device, cfg.model.seed)
        if share_output and self.is_output_rank:
            rows = max(cfg.scheduler.max_num_seqs, 1)
            self.out_buf = torch.empty(2, rows, self.hf_config.vocab_size, dtype=torch.float32, device=self.device)
            return self.out_buf
        return None

    # -- step ---------------------------------------------------------------------------
    def swap(self, pairs: list[tuple[int, int]], to_cpu: bool) -> None:
        """Copy whole blocks between this rank's device and CPU caches (ModelRunner.swap);
        layers this rank does not hold (pipeline stages) have empty caches."""
        from kvforge.engine.model_runner import swap_blocks
        swap_blocks([c for c in self.kv_caches if c.numel()], self.cpu_caches, self.backend.block_dim, pairs, to_cpu)

    @torch.inference_mode()
    def execute(self, msg: StepMessage) -> Any:
        """Run one step. Returns, on the output rank, ``(num_rows, logits, slot)`` with
        ``logits`` a float32 numpy array [R, V], or None when the rows were written to
        ``out_buf[slot]``; on the other ranks None. A step with placeholders first builds
        its inputs, then waits for the previous step's tokens (:attr:`receive_tokens`).

        Raises:
            RuntimeError: placeholders, but this transport does not deliver tokens.
        """
        from kvforge.interfaces import ForwardMetadata
        self.swap(msg.swap_out, to_cpu=True)
        self.swap(msg.swap_in, to_cpu=False)
        if len(msg.qlens) == 0:
            return (0, None, 0) if self.is_output_rank else None
        st = self.state
        par = self.config.parallel
        num_mb = (par.pipeline_micro_batches or st.pp_size) if st.pp_size > 1 else 1
        # The ranges name the phases in a profile (engine/profiling.py); no-ops when not profiling.
        with span("kvforge.build_inputs"):
            mbs = build_micro_batches(msg, num_mb, self.config.cache.block_size, self.device)
        if len(msg.ph_pos):
            with span("kvforge.wait_tokens"):
                self._fill_placeholders(msg, mbs)  # from this GPU (ph_on_device) or the driver
        n_rows = len(msg.rows)
        logits = None
        if st.pp_size == 1:
            mb = mbs[0]
            hidden = None
            with span("kvforge.forward"):
                if self.graphs is not None and mb.inputs.max_query_len == 1 and not self.calibrating:
                    hidden = self.graphs.run(mb.input_ids, mb.positions, mb.inputs)
                if hidden is None:
                    meta = ForwardMetadata(self.backend.build_metadata(mb.inputs), self.kv_caches)
                    hidden = self.model(mb.input_ids, mb.positions, meta)
                    self.calibrating = False
                if n_rows:
                    logits = self.model.compute_logits(hidden[mb.row_idx])
        else:
            logits = self._pipeline(mbs, n_rows)
        if msg.sample is not None:
            return self._sample(msg, logits)
        if not self.is_output_rank:
            return None
        if logits is None:
            return (0, None, 0)
        if self.out_buf is not None and n_rows <= self.out_buf.shape[1]:
            slot, self._slot = self._slot, 1 - self._slot
            with span("kvforge.logits_out"):
                self.out_buf[slot, :n_rows].copy_(logits)
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()
            return (n_rows, None, slot)
        return (n_rows, logits.float().cpu().numpy(), 0)

    def _fill_placeholders(self, msg: StepMessage, mbs) -> None:
        """Wait for the previous step's sampled tokens and write them into the placeholder
        input ids (on the device)."""
        from kvforge.engine.host_staging import upload
        if msg.ph_on_device:
            if self.prev_tokens is None:
                raise RuntimeError("placeholders on the device, but no step was sampled on the workers")
            vals = None  # gathered from this GPU's tokens below (pinned uploads only: no host wait)
        else:
            if self.receive_tokens is None:
                raise RuntimeError("a step with placeholder tokens, but this transport does not deliver them")
            prev = self.receive_tokens()
            vals = np.ascontiguousarray(prev[msg.ph_row], dtype=np.int64)
        for mb in mbs:
            sel = np.nonzero((msg.ph_pos >= mb.token_start) & (msg.ph_pos < mb.token_start + mb.num_tokens))[0]
            if not len(sel):
                continue
            pos = msg.ph_pos[sel] - mb.token_start
            if vals is None:
                pos_t, row_t = upload([pos, msg.ph_row[sel]], self.device)
                mb.input_ids[pos_t] = self.prev_tokens[row_t]
            else:
                pos_t, val_t = upload([pos, vals[sel]], self.device)
                mb.input_ids[pos_t] = val_t

    def _sample(self, msg: StepMessage, logits: torch.Tensor | None) -> "SampledStep | None":
        """Sample the step's rows on the output rank and share the tokens with the other
        tensor-parallel ranks (GPU broadcast), where the next step's placeholders read them.

        A sampling error does not stop the replica: the rows get token 0 (so every rank
        stays in step) and the driver fails the step's requests with the message."""
        from kvforge.distributed.communication import tp_broadcast
        ws = msg.sample
        k = len(ws.handles)
        pending, error = None, None
        with span("kvforge.sample"):
            if self.sampler is not None:
                try:
                    self.sampler.update(ws)
                    pending = self.sampler.sample(logits[:k], ws)
                    tokens = pending.token_ids
                except Exception as e:  # noqa: BLE001 - reported to the driver, per step
                    error = f"{type(e).__name__}: {e}"
                    tokens = torch.zeros(k, dtype=torch.int64, device=self.device)
            else:
                tokens = torch.empty(k, dtype=torch.int64, device=self.device)
            self.prev_tokens = tp_broadcast(tokens, 0)
        return SampledStep(pending, error) if self.is_output_rank else None

    def _pipeline(self, mbs, n_rows: int) -> torch.Tensor | None:
        """GPipe forward over the micro-batches: receive a micro-batch's activations from the
        previous stage, run this stage's layers, send them on without waiting (``isend``),
        and start the next micro-batch — so stage s works on micro-batch m while stage s+1
        works on m - 1. The last stage computes the logits of each micro-batch's rows."""
        from kvforge.interfaces import ForwardMetadata
        st = self.state
        h = self.hf_config.hidden_size
        sends = []
        logits = None
        if st.is_last_stage and n_rows:
            logits = torch.empty(n_rows, self.hf_config.vocab_size, dtype=torch.float32, device=self.device)
        for mb in mbs:
            inter = None
            if not st.is_first_stage:
                buf = pp_recv((2, mb.num_tokens, h), self.dtype, st.pp_rank - 1, self.device)
                inter = {"hidden_states": buf[0], "residual": buf[1]}
            with span("kvforge.forward"):
                meta = ForwardMetadata(self.backend.build_metadata(mb.inputs), self.kv_caches)
                out = self.model(mb.input_ids, mb.positions, meta, intermediate_tensors=inter)
            if not st.is_last_stage:
                sends.append(pp_isend(torch.stack([out["hidden_states"], out["residual"]]), st.pp_rank + 1))
            elif logits is not None and mb.row_idx.numel():
                logits[mb.out_idx] = self.model.compute_logits(out[mb.row_idx])
        for w in sends:
            w.wait()
        return logits

    def start_profile(self, out_dir: str) -> str | None:
        """Start this rank's torch.profiler (``LLM.start_profile``); returns None, or why it
        could not (a profiler failure is the caller's error, not a dead worker)."""
        try:
            self.profiler.start(out_dir, f"rank{self.rank}")
        except Exception as e:  # noqa: BLE001 - reported to the driver
            return f"worker rank {self.rank}: {type(e).__name__}: {e}"
        return None

    def stop_profile(self) -> str | None:
        """Stop it; returns the trace written (``<dir>/rank{R}.json``), None if not started
        or if writing it failed (logged: a profiler failure is not a dead worker)."""
        try:
            return self.profiler.stop()
        except Exception:  # noqa: BLE001
            log.exception("rank %d: could not write its profiler trace", self.rank)
            return None

    def shutdown(self) -> None:
        self.stop_profile()
        ps.destroy_parallel_state()

