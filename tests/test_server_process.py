"""``kvforge serve`` as a subprocess: no chat template -> 400, ``kvforge bench serve``
against it, SIGTERM draining in-flight requests before a clean exit (status 0), and a JSON 503
for a request still running at --drain-timeout.
The tests run in file order; the last one stops the server."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from helpers import STORIES_MODEL
from test_server_common import free_port


def _spawn(log, *extra: str):
    """``kvforge serve`` on stories260K as a subprocess, once /health answers: (process, base URL)."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvforge.entrypoints.cli", "serve", "--model", STORIES_MODEL, "--port", str(port),
           "--dtype", "float32", "--max-num-seqs", "16", "--num-gpu-blocks", "256", "--max-model-len", "256",
           "--served-model-name", "tiny", "--log-level", "warning", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert p.poll() is None, f"server exited early:\n{log.read_text()}"
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"server did not come up:\n{log.read_text()}"
        time.sleep(0.2)
    return p, base


def _post_in_thread(base: str, body: dict) -> tuple[threading.Thread, dict]:
    """POST ``body`` to /v1/completions from a started thread; its status and JSON land in the dict."""
    result: dict = {}

    def call():
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        result["status"], result["body"] = r.status_code, r.json()

    t = threading.Thread(target=call)
    t.start()
    return t, result


def _wait_running(base: str, t: threading.Thread, at_least: int) -> None:
    """Until /metrics counts ``at_least`` running requests (``t``'s request still in flight)."""
    deadline = time.monotonic() + 30
    while True:
        m = httpx.get(f"{base}/metrics", timeout=10).text
        running = [ln for ln in m.splitlines() if ln.startswith("kvforge:num_requests_running")]
        if running and float(running[0].split()[-1]) >= at_least:
            return
        assert time.monotonic() < deadline and t.is_alive(), "the request never ran"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def proc_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    p, base = _spawn(log)
    yield p, base, log
    if p.poll() is None:
        p.kill()
        p.wait(10)


def test_chat_without_template_is_400(proc_server):
    _, base, _ = proc_server
    r = httpx.post(f"{base}/v1/chat/completions", timeout=30,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "no_chat_template" and "--chat-template" in err["message"]
    ok = httpx.post(f"{base}/v1/completions", timeout=30, json={"model": "tiny", "prompt": "Hi", "max_tokens": 3})
    assert ok.status_code == 200


def test_bench_serve(proc_server, tmp_path, capsys):
    from kvforge.entrypoints.cli import main
    _, base, _ = proc_server
    out = tmp_path / "bench.json"
    rc = main(["bench", "serve", "--base-url", base, "--num-prompts", "8", "--input-len", "8",
               "--output-len", "6", "--request-rate", "40", "--result-file", str(out), "--disable-tqdm"])
    assert rc == 0, capsys.readouterr().out
    rep = json.loads(out.read_text())
    assert rep["completed"] == 8 and rep["failed"] == 0 and rep["model"] == "tiny"
    assert rep["total_output_tokens"] == 8 * 6 and rep["total_input_tokens"] == 8 * 8
    for k in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p90", "p99"):
            assert rep[f"{stat}_{k}_ms"] >= 0
    assert rep["request_throughput"] > 0 and rep["output_throughput"] > 0
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_sigterm_drains_in_flight_requests_and_exits_0(proc_server):
    p, base, log = proc_server
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}
    t, result = _post_in_thread(base, body)
    with httpx.Client(base_url=base, timeout=120) as c:
        with c.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                       "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(ln for ln in lines if ln.startswith("data: "))
            _wait_running(base, t, 2)  # the non-streaming request is in the engine too
            p.send_signal(signal.SIGTERM)
            rest = [first] + [ln for ln in lines if ln.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    usage = json.loads(rest[-2][6:])["usage"]
    assert usage["completion_tokens"] == 200                     # the stream ran to completion
    t.join(120)
    assert result["status"] == 200 and result["body"]["usage"]["completion_tokens"] == 200
    assert p.wait(60) == 0, log.read_text()


def test_requests_past_the_drain_timeout_get_a_json_503(tmp_path):
    """At --drain-timeout the engine aborts what still runs; uvicorn's grace lasts longer, so the
    client gets the OpenAI-format 503, not a cancelled handler's plain-text 500."""
    log = tmp_path / "server.log"
    p, base = _spawn(log, "--drain-timeout", "0.05")
    try:
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 240, "ignore_eos": True, "n": 16}
        t, result = _post_in_thread(base, body)
        _wait_running(base, t, 1)
        p.send_signal(signal.SIGTERM)
        t.join(120)
        assert result["status"] == 503, result
        assert result["body"]["error"]["type"] == "service_unavailable", result
        assert p.wait(60) == 0, log.read_text()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
