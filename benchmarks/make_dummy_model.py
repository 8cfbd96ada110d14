"""Write a Hugging Face-layout model directory for benchmarks with ``--load-format dummy``.

    python benchmarks/make_dummy_model.py /tmp/llama3-8b-dummy          # Llama-3-8B shape, bf16
    python benchmarks/make_dummy_model.py /tmp/tiny-dummy --tiny         # tiny shape for CPU tests

The directory holds ``config.json`` (``LlamaForCausalLM``), ``generation_config.json`` and a tokenizer
copied from stories260K, but no weights: kvforge's ``load_format=dummy`` fills parameters with
uniform(-1e-3, 1e-3) values and ``--baseline hf`` builds the HF model with
``AutoModelForCausalLM.from_config`` (random init), so no ``*.safetensors`` is needed. The tokenizer's
512-token vocabulary is smaller than the model's: the benchmarks pass token ids, and they turn
detokenization off when the model can emit ids the tokenizer lacks. bos/eos ids are the tokenizer's
(1 and 2) so the engine's EOS detection agrees with it.

Llama-3-8B shape: hidden 4096, 32 layers, 32 query / 8 KV heads (head_dim 128), intermediate 14336,
vocab 128256, rope_theta 500000, max_position_embeddings 8192, untied embeddings, bfloat16.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

DEFAULT_TOKENIZER = "/work/shared/models/stories260K"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")

LLAMA3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
                 max_position_embeddings=8192, torch_dtype="bfloat16")
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=1024, rope_theta=10000.0, max_position_embeddings=512,
            torch_dtype="float32")


def llama_config(shape: dict) -> dict:
    """A complete ``config.json`` for ``LlamaForCausalLM`` with the given shape fields."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "rms_norm_eps": 1e-5, "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0,
            "mlp_bias": False, "tie_word_embeddings": False, "initializer_range": 0.02, "pretraining_tp": 1,
            "use_cache": True, "bos_token_id": 1, "eos_token_id": 2, **shape}


def make_dummy_model(out_dir: str | Path, tiny: bool = False, tokenizer_dir: str | Path = DEFAULT_TOKENIZER,
                     dtype: str | None = None, awq_group: int | None = None) -> Path:
    """Write the directory (created if needed; existing files are overwritten). Returns its path.
    ``awq_group``: declare an AutoAWQ GEMM int4 checkpoint with this group size
    (``quantization_config``; with ``load_format=dummy`` the packed tensors get random values).

    Raises:
        FileNotFoundError: ``tokenizer_dir`` has none of the tokenizer files.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shape = dict(TINY if tiny else LLAMA3_8B)
    if dtype:
        shape["torch_dtype"] = dtype
    cfg = llama_config(shape)
    if awq_group:
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": awq_group, "zero_point": True,
                                      "version": "gemm"}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}, indent=2) + "\n")
    copied = 0
    for name in TOKENIZER_FILES:
        src = Path(tokenizer_dir) / name
        if src.exists():
            shutil.copyfile(src, out / name)
            copied += 1
    if not copied:
        raise FileNotFoundError(f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {tokenizer_dir}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", help="directory to write")
    p.add_argument("--tiny", action="store_true", help="tiny shape (2 layers, hidden 64, vocab 1024, fp32) for CPU")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), help="override torch_dtype")
    p.add_argument("--awq-group", type=int, help="declare an AutoAWQ int4 checkpoint with this group size")
    p.add_argument("--tokenizer-dir", default=DEFAULT_TOKENIZER, help=f"copy the tokenizer from here "
                   f"(default: {DEFAULT_TOKENIZER})")
    args = p.parse_args(argv)
    out = make_dummy_model(args.out_dir, args.tiny, args.tokenizer_dir, args.dtype, args.awq_group)
    print(f"wrote {out} ({'tiny' if args.tiny else 'Llama-3-8B'} shape; use --load-format dummy)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
