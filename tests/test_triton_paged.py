"""Runs tests/triton_paged_cases.py and tests/triton_paged_engine_cases.py: natively on
CUDA hosts, and on CPU hosts in a child
pytest with TRITON_INTERPRET=1 set before anything imports Triton.

Triton decides interpreter vs compiler when a kernel is decorated, so interpreting
in this process would depend on which test module imported the kernels first."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))

if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    from triton_paged_cases import *  # noqa: F401,F403
    from triton_paged_engine_cases import *  # noqa: F401,F403
    from triton_paged_fp8_cases import *  # noqa: F401,F403
else:
    def test_triton_paged_cases_under_interpreter():
        env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               os.path.join(HERE, "triton_paged_cases.py"),
                               os.path.join(HERE, "triton_paged_engine_cases.py"),
                               os.path.join(HERE, "triton_paged_fp8_cases.py")],
                              env=env, cwd=HERE, capture_output=True, text=True, timeout=1200)
        tail = proc.stdout[-6000:] + proc.stderr[-2000:]
        assert proc.returncode == 0, tail
        last = proc.stdout.strip().splitlines()[-1]
        passed = int(last.split(" passed")[0].split()[-1])
        assert passed >= 40, f"only {passed} interpreter cases ran: {last}"
