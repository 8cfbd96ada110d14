"""AsyncLLMEngine without HTTP: streaming, abort, duplicate ids, failures, drain."""
from __future__ import annotations

import asyncio

import pytest

from helpers import assert_no_block_leak, make_engine
from kvforge import SamplingParams
from kvforge.engine.async_engine import AsyncLLMEngine, EngineClosedError, EngineError
from kvforge.entrypoints.openai.serving_common import ChoiceDelta, clamp


@pytest.fixture(scope="module")
def core():
    return make_engine(dtype="float32", max_num_seqs=16, num_gpu_blocks=256, max_model_len=256)


def _run(core, coro_fn, drain: float = 5.0):
    async def main():
        eng = AsyncLLMEngine(core)
        eng.start()
        try:
            return await coro_fn(eng)
        finally:
            await eng.shutdown(drain)
    return asyncio.run(main())


def test_streams_cumulative_outputs_and_finishes(core):
    async def go(eng):
        outs = [o async for o in eng.generate("a", "Once upon a time", SamplingParams(temperature=0, max_tokens=8))]
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        lens = [len(o.outputs[0].token_ids) for o in outs]
        assert lens == sorted(lens) and lens[-1] == 8
        return outs[-1].outputs[0].text

    text = _run(core, go)
    ref = core  # the same engine, driven offline after the async wrapper stopped
    ref.add_request("offline", "Once upon a time", SamplingParams(temperature=0, max_tokens=8))
    final = None
    while ref.has_unfinished_requests():
        for o in ref.step():
            final = o if o.finished else final
    assert final.outputs[0].text == text
    assert_no_block_leak(core)


def test_abort_frees_blocks_within_one_step(core):
    async def go(eng):
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        stream = await eng.add_request("long", "Once upon a time", params)
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 3:
                break
        steps_at_abort = eng.num_steps
        stream.abort()
        while eng.num_in_flight():
            await asyncio.sleep(0.005)
        assert eng.num_steps - steps_at_abort <= 2
        assert core.allocator.num_free_blocks == core.allocator.num_blocks

    _run(core, go)


def test_duplicate_and_invalid_requests_rejected(core):
    async def go(eng):
        params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
        stream = await eng.add_request("dup", "Once upon a time", params)
        with pytest.raises(ValueError, match="already in flight"):
            await eng.add_request("dup", "Hello", params)
        with pytest.raises(ValueError, match="max_model_len"):
            await eng.add_request("big", {"prompt_token_ids": [1] * 10_000}, params)
        async for _ in stream:
            pass
        again = await eng.add_request("dup", "Hello", SamplingParams(max_tokens=2))
        async for _ in again:
            pass
        assert eng.num_in_flight() == 0

    _run(core, go)
    assert_no_block_leak(core)


def test_step_exception_fails_in_flight_requests_and_engine_survives(core, monkeypatch):
    orig = core.step
    calls = {"n": 0}

    def broken():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("scheduler exploded")
        return orig()

    async def go(eng):
        monkeypatch.setattr(core, "step", broken)
        with pytest.raises(EngineError, match="scheduler exploded"):
            async for _ in eng.generate("x", "Once upon a time", SamplingParams(max_tokens=20, ignore_eos=True)):
                pass
        monkeypatch.setattr(core, "step", orig)
        outs = [o async for o in eng.generate("y", "Hello", SamplingParams(max_tokens=3))]
        assert outs[-1].finished and eng.is_running

    _run(core, go)
    assert_no_block_leak(core)


def test_shutdown_drains_then_rejects(core):
    async def go(eng):
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        stream = await eng.add_request("drain-me", "Once upon a time", params)

        async def consume():
            return [o async for o in stream][-1]

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.01)
        await eng.shutdown(drain_timeout=30)
        final = await task
        assert final.finished and len(final.outputs[0].token_ids) == 30
        with pytest.raises(EngineClosedError):
            await eng.add_request("late", "Hello", params)

    _run(core, go)
    assert_no_block_leak(core)


def test_shutdown_timeout_aborts_the_rest(core):
    async def go(eng):
        stream = await eng.add_request("slow", "Once", SamplingParams(max_tokens=250, ignore_eos=True))
        await eng.shutdown(drain_timeout=0.05)
        with pytest.raises(EngineClosedError):
            async for _ in stream:
                pass

    _run(core, go)
    assert_no_block_leak(core)


def test_choice_delta():
    from kvforge.engine.outputs import CompletionOutput
    d = ChoiceDelta(SamplingParams(stop=[" was"]))
    assert d.update(CompletionOutput(0, "Once", [1, 2]))[:2] == ("Once", [1, 2])
    assert d.update(CompletionOutput(0, "Once", [1, 2, 3]))[:2] == ("", [3])
    text, ids, _, fin = d.update(CompletionOutput(0, "Once wa", [1, 2, 3], finish_reason="length"))
    assert (text, ids, fin) == (" wa", [], True)
    assert clamp(float("-inf")) == -9999.0 and clamp(float("nan")) == -9999.0 and clamp(-1.5) == -1.5


def test_soak_random_aborts_no_leak(core):
    """3000 short requests, 48 at a time, a third aborted at random points: every stream
    ends, no id stays reserved, no KV block leaks, and the engine holds no request state."""
    import random
    import tracemalloc

    from helpers import fresh_rng
    rng: random.Random = fresh_rng("soak")
    total, width = 3000, 48

    async def go(eng):
        sem = asyncio.Semaphore(width)
        ended = {"finished": 0, "aborted": 0}

        async def one(i: int) -> None:
            async with sem:
                params = SamplingParams(temperature=1.0, max_tokens=rng.randint(1, 6), seed=i)
                abort_after = rng.randint(0, 3) if rng.random() < 0.33 else None
                stream = await eng.add_request(f"soak-{i}", [1] + [rng.randrange(3, 500) for _ in range(4)],
                                               params)
                seen = 0
                async for out in stream:
                    seen += 1
                    if abort_after is not None and seen > abort_after and not out.finished:
                        stream.abort()
                        ended["aborted"] += 1
                        return
                ended["finished"] += 1

        await asyncio.gather(*(one(i) for i in range(total - 300)))
        # memory is stable: the last 300 requests leave no Python allocations behind
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        await asyncio.gather(*(one(i) for i in range(total - 300, total)))
        while eng.num_in_flight():
            await asyncio.sleep(0.01)
        grown = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        deadline = asyncio.get_running_loop().time() + 10
        while eng.num_in_flight() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert eng.num_in_flight() == 0
        assert ended["finished"] + ended["aborted"] == total and ended["aborted"] > 180
        assert grown < 2 * 2**20, f"traced memory grew by {grown / 2**20:.1f} MiB over 300 requests"

    _run(core, go)
    assert_no_block_leak(core)
    assert not core.has_unfinished_requests() and not core.outputs.parents


def test_engine_thread_death_fails_requests_instead_of_hanging(core, monkeypatch):
    async def go(eng):
        def boom(outs):
            raise RuntimeError("bug in dispatch")

        monkeypatch.setattr(eng, "_dispatch", boom)
        with pytest.raises(EngineError, match="bug in dispatch"):
            async for _ in eng.generate("d1", "Once", SamplingParams(max_tokens=5)):
                pass
        assert not eng.is_running and eng.dead is not None
        with pytest.raises(EngineError):
            await eng.add_request("d2", "Once", SamplingParams(max_tokens=5))

    _run(core, go)
    assert_no_block_leak(core)
    assert not core.outputs.parents
