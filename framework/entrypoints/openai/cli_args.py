"""Flags of ``kvforge serve`` (kept free of heavy imports so the CLI stays fast)."""
from __future__ import annotations

import argparse


def port_number(text: str) -> int:
    """``--port``: an integer in 0..65535 (0: any free port).

    Raises:
        argparse.ArgumentTypeError: otherwise (argparse reports it as a usage error naming --port).
    """
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer in 0..65535, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535, got {port}")
    return port


def seconds(text: str) -> float:
    """A duration flag: a finite number of seconds >= 0.

    Raises:
        argparse.ArgumentTypeError: otherwise (a usage error naming the flag).
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (a number >= 0), got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value


def model_name(text: str) -> str:
    """A ``--served-model-name``: a non-empty name without surrounding whitespace (clients match
    it exactly).

    Raises:
        argparse.ArgumentTypeError: otherwise.
    """
    if not text or text != text.strip():
        raise argparse.ArgumentTypeError(f"must be a non-empty name without surrounding spaces, got {text!r}")
    return text


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Server flags (the engine flags are added by the CLI's ``_add_engine_flags``)."""
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8000, help="TCP port, 0..65535 (default 8000)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (env KVFORGE_API_KEY)")
    p.add_argument("--served-model-name", action="append", default=None, metavar="NAME", type=model_name,
                   help="model name clients use (repeatable; default: the --model path)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="Jinja chat template file (checked at start-up)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a chat request's own chat_template (refused with a 400 by default: "
                        "a template is code the server runs)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let chat requests use tool_choice 'auto' (the default with tools): answers are parsed "
                        "for tool calls by --tool-call-parser")
    from kvforge.entrypoints.openai.tool_parsers import PARSERS
    p.add_argument("--tool-call-parser", choices=sorted(PARSERS), default=None,
                   help="tool-call format of the model's answers: hermes (<tool_call>{json}</tool_call>; Qwen2.5, "
                        "Hermes), llama3_json ({\"name\": ..., \"parameters\": ...}; Llama 3.1/3.2), mistral "
                        "([TOOL_CALLS][{...}]), pythonic ([f(x=1), g()]; Llama 3.2/4); needed by "
                        "--enable-auto-tool-choice")
    p.add_argument("--drain-timeout", type=seconds, default=30.0,
                   help="seconds to wait for in-flight requests on shutdown (default 30)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
