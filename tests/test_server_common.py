"""Shared live-server helpers for the tests/test_server_*.py files (plus a smoke test).

One in-process server (uvicorn in a background thread, 127.0.0.1, a free port) is started
lazily and shared by every server test file; it is stopped at session end.
"""
from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from helpers import STORIES_MODEL, make_engine

KEY = "sk-kvforge-test"
MODEL_NAME = "stories"
#: A tiny chat template (the stories260K tokenizer has none).
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
ENGINE_KW = dict(dtype="float32", max_num_seqs=32, num_gpu_blocks=512, block_size=16, max_model_len=256)

_cache: dict[str, object] = {}
_lock = threading.Lock()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """A running in-process server: ``base_url``, ``engine`` (AsyncLLMEngine), ``app``."""

    def __init__(self, api_key: str | None = KEY, chat_template: str | None = CHAT_TEMPLATE) -> None:
        import uvicorn

        from kvforge.engine.async_engine import AsyncLLMEngine
        from kvforge.entrypoints.openai.api_server import build_app
        self.engine = AsyncLLMEngine(make_engine(**ENGINE_KW))
        self.app = build_app(self.engine, [MODEL_NAME], api_key=api_key, chat_template=chat_template,
                             drain_timeout=5.0)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive(), "server thread died during startup"
            assert time.monotonic() < deadline, "server did not start in 60 s"
            time.sleep(0.05)

    @property
    def allocator(self):
        return self.engine.engine.allocator

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {KEY}"}

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.headers(), timeout=kw.pop("timeout", 60), **kw)

    def openai(self):
        import openai
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=KEY, max_retries=0, timeout=60)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Wait until no request is in flight and every KV block is free; fail otherwise."""
        deadline = time.monotonic() + timeout
        alloc = self.allocator
        while time.monotonic() < deadline:
            if self.engine.num_in_flight() == 0 and alloc.num_free_blocks == alloc.num_blocks:
                return
            time.sleep(0.02)
        raise AssertionError(f"not idle after {timeout} s: in flight {self.engine.num_in_flight()}, "
                             f"{alloc.num_blocks - alloc.num_free_blocks} KV blocks still allocated")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def live_server(request) -> LiveServer:
    """The shared server (started on first use, stopped at session end)."""
    with _lock:
        if "server" not in _cache:
            srv = LiveServer()
            _cache["server"] = srv
            request.session.config.add_cleanup(srv.stop)
        return _cache["server"]  # type: ignore[return-value]


def reference_llm():
    """An offline ``kvforge.LLM`` with the server's engine configuration."""
    with _lock:
        if "llm" not in _cache:
            from kvforge import LLM
            _cache["llm"] = LLM(STORIES_MODEL, **ENGINE_KW)
        return _cache["llm"]


def sse_events(resp: httpx.Response) -> list:
    """Parse an SSE body into JSON objects; the last element is the string ``"[DONE]"``."""
    import json
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.fixture(scope="module")
def server(request) -> LiveServer:
    return live_server(request)


def test_health_models_and_auth(server):
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        assert c.get("/health").status_code == 200          # open without a key
        assert c.get("/metrics").status_code == 200
        r = c.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = c.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and "incorrect API key" in r.json()["error"]["message"]
        r = c.post("/tokenize", json={"prompt": "hi"})
        assert r.status_code == 401
    models = server.openai().models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    import openai
    bad = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
