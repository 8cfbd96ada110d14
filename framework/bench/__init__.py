"""Benchmarks: ``kvforge bench ab`` (scheduler A/B harness), ``bench calibrate`` (its simulator's
cost model) and, registered by :mod:`kvforge.entrypoints.cli`, ``bench serve``.

Each ``bench`` subcommand is registered by one small function taking the ``bench`` group's
subparsers action; :func:`add_bench_subparsers` creates the group (or reuses it) and calls them.
Heavy imports (torch, the engine) happen only when a subcommand runs.
"""
from __future__ import annotations

import argparse


def bench_subparsers(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """The ``bench`` group's subparsers action, creating ``kvforge bench`` on ``sub`` if needed."""
    bench = sub.choices.get("bench")
    if bench is None:
        bench = sub.add_parser("bench", help="benchmarks (kvforge bench -h lists them)")
        bench.set_defaults(func=lambda a: (bench.print_help(), 2)[1])
    action = next((a for a in bench._actions if isinstance(a, argparse._SubParsersAction)), None)
    if action is None:
        action = bench.add_subparsers(dest="bench_command")
    return action


def add_bench_subparsers(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """Register ``kvforge bench ab`` and ``kvforge bench calibrate``; returns the group's action so
    more subcommands can be added (``bench_sub.add_parser(...)``)."""
    from kvforge.bench.ab import add_ab_parser
    from kvforge.bench.calibrate import add_calibrate_parser
    action = bench_subparsers(sub)
    add_ab_parser(action)
    add_calibrate_parser(action)
    from kvforge.bench.latency import add_latency_parser
    from kvforge.bench.throughput import add_throughput_parser
    add_throughput_parser(action)
    add_latency_parser(action)
    return action
