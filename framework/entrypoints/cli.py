"""``kvforge`` command line: ``generate``, ``plugins``, ``serve`` and ``bench serve``."""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from typing import Any

from pydantic import ValidationError

from kvforge.config import FLAT_FIELDS, EngineConfig, config_error_message


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory (Hugging Face layout); or model.model in --config")
    p.add_argument("--config", help="YAML or JSON engine config; flags override it")
    for name in sorted(FLAT_FIELDS):
        if name == "model":
            continue
        p.add_argument(f"--{name.replace('_', '-')}", dest=f"cfg_{name}", default=None, metavar=name.upper(),
                       help=_flag_help(FLAT_FIELDS[name]))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any config path, e.g. scheduler.settings.foo=1 (values of flags and --set are parsed as "
                        "JSON where they can be: a list is '[1,2,4]')")


def _field(path: str) -> Any:
    """The pydantic field of the config at a dotted ``path``."""
    model: Any = EngineConfig
    *sections, name = path.split(".")
    for sec in sections:
        model = model.model_fields[sec].annotation
    return model.model_fields[name]


def _nullable(path: str) -> bool:
    import typing
    return type(None) in typing.get_args(_field(path).annotation)


def _flag_help(path: str) -> str:
    """``--flag`` help from the config field at ``path``: where it goes, what it means, its
    default and bounds (argparse reads ``%`` as a format character, so it is doubled)."""
    f = _field(path)
    default = f.get_default(call_default_factory=True)
    text = f"{path}" + (f": {f.description}" if f.description else "")
    text += f" (default {'null' if default is None else repr(default)}{_bounds(f)})"
    return text.replace("%", "%%")


def _parse_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Flags -> overrides for :meth:`EngineConfig.from_sources`."""
    out: dict[str, Any] = {"model.model": args.model} if args.model else {}
    for k, v in vars(args).items():
        if k.startswith("cfg_") and v is not None:
            out[k[4:]] = _parse_value(v) if v not in ("auto",) else v
            if out[k[4:]] is None and not _nullable(FLAT_FIELDS[k[4:]]):  # (None would mean "not given")
                flag = "--" + k[4:].replace("_", "-")
                raise ValueError(f"{flag}: null is not a value of {FLAT_FIELDS[k[4:]]}; leave the flag out for "
                                 "its default")
    flags = {FLAT_FIELDS.get(k, k): k for k in out}  # path -> the flag that set it
    for item in args.set:
        if "=" not in item:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        path = FLAT_FIELDS.get(k, k)
        if path in flags:  # which one wins would be an accident of the code, not the user's choice
            flag = "--model" if flags[path] == "model.model" else f"--{flags[path].replace('_', '-')}"
            raise ValueError(f"--set {k}=...: {path} is also set by {flag}; give it once")
        out[k] = _parse_value(v)
    return out


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def _unescape(text: str) -> str:
    """``\\n``, ``\\t``, ``\\r`` and ``\\\\`` typed on a shell command line as the characters they
    name (a shell passes ``--stop '\\n'`` as a backslash and an n); other text is kept as is."""
    return re.sub(r"\\([ntr\\])", lambda m: _ESCAPES[m.group(1)], text)


def _sampling_from_args(args: argparse.Namespace):
    from kvforge import SamplingParams
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          max_tokens=args.max_tokens, seed=args.seed_sampling, n=args.n,
                          stop=args.stop or None, logprobs=args.logprobs, ignore_eos=args.ignore_eos,
                          repetition_penalty=args.repetition_penalty)


def cmd_generate(args: argparse.Namespace) -> int:
    from kvforge.entrypoints.llm import LLM
    sp = _sampling_from_args(args)
    llm = LLM(config=args.config, **engine_overrides(args))
    outs = llm.generate(args.prompts, sp, use_tqdm=not args.json)
    if args.json:
        print(json.dumps([dataclasses.asdict(o) for o in outs], indent=2, default=str))
    else:
        for o in outs:
            for c in o.outputs:
                print(f"{o.prompt}{c.text}")
                if o.error:
                    print(f"[error: {o.error}]", file=sys.stderr)
                print(f"[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]", file=sys.stderr)
    # A request that ended in an error makes the command fail (scripts check the status).
    return 1 if any(o.error or any(c.finish_reason == "error" for c in o.outputs) for o in outs) else 0


def cmd_plugins(args: argparse.Namespace) -> int:
    from kvforge.plugin_manager import load_registry
    reg = load_registry(keep_going=True)  # list what works, and name what does not
    for plugin, dist, err in reg.broken:
        print(f"broken plugin {plugin!r} (distribution {dist}), left out: {err}", file=sys.stderr)
    from kvforge.engine.capabilities import unknown_capabilities
    for spec in reg.all():  # likely typos: they would be ignored
        for msg in unknown_capabilities(spec):
            print(f"warning: {msg}", file=sys.stderr)
    specs = _settings_specs(reg, args.settings) if args.settings is not None else None
    if specs == []:  # refused before any output
        return 2
    if not specs and not args.explain:  # the table unless a section was asked for
        rows = [(s.kind, s.name, s.plugin, s.distribution, s.version, s.hook_api) for s in reg.all()]
        rows.sort()
        head = ("KIND", "NAME", "PLUGIN", "DISTRIBUTION", "VERSION", "HOOK API")
        widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
        for r in [head] + rows:
            print("  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip())
    if specs:
        _print_settings(specs)
    if args.explain:
        _explain(args, reg)
    return 1 if reg.broken else 0


#: Where each plugin kind's settings go in the engine config.
SETTINGS_PATHS = {"attention": "attention.settings", "quantizer": "quantization.settings",
                  "scheduler": "scheduler.settings", "kv_allocator": "cache.settings",
                  "drafter": "speculative.settings"}


def _type_name(t) -> str:
    """``Literal['a', 'b']`` -> ``'a' | 'b'``; a class -> its name; else its repr, shortened."""
    import typing
    if typing.get_origin(t) is typing.Literal:
        return " | ".join(repr(v) for v in typing.get_args(t))
    if isinstance(t, type):
        return t.__name__
    return str(t).replace("typing.", "")


def _settings_specs(reg, which: str) -> list:
    """The plugins ``which`` (KIND, KIND:NAME or empty) selects; [] with a message on stderr
    naming the kinds, or the kind's names, when it selects none."""
    kind_f, _, name_f = which.partition(":")
    specs = [s for s in sorted(reg.all(), key=lambda s: (s.kind, s.name))
             if (not kind_f or s.kind == kind_f) and (not name_f or s.name == name_f)]
    if not specs:
        kinds = sorted({s.kind for s in reg.all()})
        names = sorted(s.name for s in reg.all() if s.kind == kind_f)
        known = f"{kind_f} names: {', '.join(names)}" if names else f"kinds: {', '.join(kinds)}"
        print(f"plugins --settings: no plugin matches {which!r} (KIND[:NAME]; {known})", file=sys.stderr)
    return specs


_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="), ("min_length", "length >="),
           ("max_length", "length <="))


def _bounds(field) -> str:
    """A pydantic field's numeric / length constraints (``Field(ge=0, le=1)``) as ``, >= 0, <= 1``."""
    out = [f"{sym} {getattr(m, attr)}" for m in field.metadata for attr, sym in _BOUNDS
           if getattr(m, attr, None) is not None]
    return "".join(f", {b}" for b in out)


def _print_settings(specs: list) -> None:
    """Each plugin's settings (its pydantic model's fields: type, default, bounds) under the
    config path that takes them."""
    for spec in specs:
        model = spec.settings_model
        fields = getattr(model, "model_fields", {}) if model is not None else {}
        where = SETTINGS_PATHS.get(spec.kind, f"{spec.kind}.settings")
        print(f"{spec.kind} {spec.name}: " + (f"{where}" if fields else "no settings"))
        for fname, f in fields.items():
            ann = _type_name(f.annotation)
            default = "required" if f.is_required() else f"default {f.get_default(call_default_factory=True)!r}"
            print(f"  {fname}: {ann} ({default}{_bounds(f)})" + (f" - {f.description}" if f.description else ""))


def _explain(args: argparse.Namespace, reg) -> None:
    """Show why each attention backend is or is not eligible for ``auto`` on this machine, and
    which one ``auto`` picks, for the model of --model or of --config (required: its head
    sizes and dtype decide)."""
    from kvforge.engine.builder import load_hf_config
    from kvforge.engine.resolve import backend_reasons, choose_attention, resolve_device, resolve_dtype
    from kvforge.interfaces import AttentionRequirements
    from kvforge.layers.kv_cache_dtype import resolve_kv_cache_dtype
    cfg = EngineConfig.from_sources(args.config, {"model": args.model} if args.model else {})
    model = cfg.model.model
    hf = load_hf_config(model)
    dev = resolve_device(cfg.model.device)
    dtype = resolve_dtype(cfg.model.dtype, hf)
    nh = hf.num_attention_heads
    kv_dtype = resolve_kv_cache_dtype(cfg.cache.kv_cache_dtype, dtype)  # (an FP8 cache rules backends out)
    req = AttentionRequirements(dtype, getattr(hf, "head_dim", None) or hf.hidden_size // nh, nh,
                                getattr(hf, "num_key_value_heads", None) or nh, cfg.cache.block_size, kv_dtype)
    try:
        picked = choose_attention(reg, "auto", req, dev)[0].name
    except ValueError:
        picked = None
    kv_note = f"; kv_cache_dtype {cfg.cache.kv_cache_dtype}" if kv_dtype != dtype else ""
    print(f"\nattention backends for {model} on {dev} ({dtype}; block_size {cfg.cache.block_size}{kv_note}):")
    for name in reg.names("attention"):
        spec = reg.get("attention", name)
        reasons = backend_reasons(spec, req, dev)  # (as choose_attention decides)
        prio = spec.capabilities.get("priority", 0)
        verdict = ("rejected: " + "; ".join(reasons) if reasons else
                   "ok" + (", picked by auto" if name == picked else ""))
        print(f"  {name} (priority {prio}): {verdict}")
    configured = cfg.attention.backend
    if configured != "auto":
        print(f"  (the config names attention.backend {configured!r})")


def cmd_serve(args: argparse.Namespace) -> int:
    from kvforge.entrypoints.openai.api_server import run_server
    return run_server(args, engine_overrides(args))


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from kvforge.bench.serve import run_bench_serve
    return run_bench_serve(args)


def _add_serve_parsers(sub) -> None:
    """``kvforge serve`` and ``kvforge bench serve`` (reuses a ``bench`` group if one exists)."""
    from kvforge.bench.serve import add_bench_serve_args
    from kvforge.entrypoints.openai.cli_args import add_serve_args
    sv = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    _add_engine_flags(sv)
    add_serve_args(sv)
    sv.set_defaults(func=cmd_serve)
    bench = sub.choices.get("bench")
    if bench is None:
        bench = sub.add_parser("bench", help="benchmarks")
        bench.set_defaults(func=lambda a: (bench.print_help(), 2)[1])
    bench_sub = next((a for a in bench._actions if isinstance(a, argparse._SubParsersAction)), None)
    if bench_sub is None:
        bench_sub = bench.add_subparsers(dest="bench_command")
    bs = bench_sub.add_parser("serve", help="benchmark a running server (Poisson arrivals, streaming)")
    add_bench_serve_args(bs)
    bs.set_defaults(func=cmd_bench_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvforge", description="kvforge: plugin-based LLM inference")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default=None,
                        help="print kvforge's log records from this level on to stderr (info: the plugins chosen, "
                             "the weights' memory, the KV blocks); before the command: kvforge --log-level info generate ...")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for prompts")
    _add_engine_flags(g)
    g.add_argument("prompts", nargs="+", metavar="PROMPT")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--stop", action="append", type=_unescape, metavar="TEXT",
                   help="stop string, repeatable; \\n, \\t, \\r and \\\\ are read as escapes (--stop '\\n')")
    g.add_argument("--logprobs", type=int, default=None, help="top log-probabilities per token (shown with --json)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--sampling-seed", dest="seed_sampling", type=int, default=None)
    g.add_argument("--json", action="store_true", help="print full RequestOutputs as JSON")
    g.set_defaults(func=cmd_generate)
    pl = sub.add_parser("plugins", help="list installed plugins")
    pl.add_argument("--explain", action="store_true", help="show why each attention backend can or cannot run")
    pl.add_argument("--model", help="model directory for --explain")
    pl.add_argument("--settings", nargs="?", const="", default=None, metavar="KIND[:NAME]",
                    help="list each plugin's settings and their config path (optionally one kind or plugin)")
    pl.add_argument("--config", help="engine config (YAML or JSON) --explain reads the model, device, dtype and "
                    "block_size from")
    pl.set_defaults(func=cmd_plugins)
    from kvforge.bench import add_bench_subparsers
    add_bench_subparsers(sub)  # `bench ab`, `bench calibrate`; `bench serve` joins the same group below
    _add_serve_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.log_level:
        import logging
        root = logging.getLogger("kvforge")
        if not any(getattr(h, "kvforge_cli", False) for h in root.handlers):  # (main may run twice in a process)
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
            handler.kvforge_cli = True
            root.addHandler(handler)
        root.setLevel(args.log_level.upper())
    try:
        return args.func(args)
    except ValidationError as e:  # one line per field, as the other input errors read
        print(f"kvforge: error: {config_error_message(e)}", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError, OSError) as e:
        # the notes name the plugin an error came from (build_plugin, checked_schedule)
        notes = "".join(f"\n  {n}" for n in getattr(e, "__notes__", ()))
        print(f"kvforge: error: {e}{notes}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
