"""Ctrl-C during ``LLM.generate`` with tensor or data parallelism (CPU, gloo, mp executor).

A KeyboardInterrupt that stops the driver mid-step used to leave it out of step with its
workers (TP: the executor declared itself dead; DP: the next call read the interrupted
call's answer as its own), so the next ``generate`` failed or hung. Now the next call
resynchronizes: it must return what an uninterrupted run returns, with every KV block back
and nothing left in flight. An interrupt that tears a message must give a clear error,
never a hang.

The interrupt is injected where a real one lands, deterministically: from the driver's
wait for an answer once the answer is ready (so it sits unread), from the driver's sampler
or detokenizer, or as a simulated SIGINT (``_thread.interrupt_main``) while a message is
being written.
"""
from __future__ import annotations

import _thread
import signal
import time
from multiprocessing.connection import Connection

import pytest

from helpers import STORIES_MODEL, STORY_OPENINGS
from kvforge import LLM, SamplingParams
from kvforge.distributed import mp as mp_mod
from kvforge.distributed import replicas as replicas_mod
from kvforge.distributed.interrupts import defer_sigint

COMMON = dict(num_gpu_blocks=96, max_num_batched_tokens=32, dtype="float32")
PROMPTS = STORY_OPENINGS[:4]
PARAMS = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 14, 9, 20)]


def _shutdown(llm) -> None:
    eng = llm.llm_engine
    (eng.executor.shutdown if hasattr(eng, "executor") else eng.shutdown)()


class _Llm:
    """An LLM and its own uninterrupted greedy outputs (the reference)."""

    def __init__(self, **kw) -> None:
        self.llm = LLM(model=STORIES_MODEL, **COMMON, **kw)
        self.ref = self.generate()

    def generate(self):
        return [o.outputs[0].token_ids for o in self.llm.generate(PROMPTS, PARAMS, use_tqdm=False)]

    def interrupted(self, hook) -> None:
        with pytest.raises(KeyboardInterrupt):
            self.generate()
        assert hook.fired, "the interrupt was not injected"

    def check_recovered(self, tag: str) -> None:
        outs = self.llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert [o.error for o in outs] == [None] * len(outs), tag
        assert [o.outputs[0].token_ids for o in outs] == self.ref, f"{tag}: outputs differ from a fresh run's"
        eng = self.llm.llm_engine
        assert eng.get_num_unfinished_requests() == 0 and not eng.has_unfinished_requests(), tag
        if hasattr(eng, "replica_stats"):
            assert sum(eng.in_flight) == 0, tag
            for i, st in enumerate(eng.replica_stats()):
                assert st["num_free_blocks"] == st["num_blocks"], f"{tag}: replica {i} holds KV blocks"
                assert st["num_unfinished_requests"] == 0, f"{tag}: replica {i} kept requests"
        else:
            a = eng.allocator
            assert a.num_free_blocks == a.num_blocks, f"{tag}: {a.num_blocks - a.num_free_blocks} KV blocks held"


@pytest.fixture(scope="module")
def tp_sync():
    m = _Llm(tensor_parallel_size=2)
    yield m
    _shutdown(m.llm)


@pytest.fixture(scope="module")
def tp_async():
    m = _Llm(tensor_parallel_size=2, async_scheduling=True)
    yield m
    _shutdown(m.llm)


@pytest.fixture(scope="module")
def tp_worker_sampling():
    m = _Llm(tensor_parallel_size=2, async_scheduling=True, sample_on_worker=True)
    assert m.llm.llm_engine.executor.samples_on_worker
    yield m
    _shutdown(m.llm)


@pytest.fixture(scope="module")
def dp():
    m = _Llm(data_parallel_size=2)
    yield m
    _shutdown(m.llm)


class _WaitHook:
    """Replaces a module's ``mp_wait``: once armed, the first wait that finds an answer
    ready raises KeyboardInterrupt instead of returning it (the answer stays unread). With
    ``partial``, that wait first returns one ready pipe only (so one rank's answer is
    read), and the next wait raises."""

    def __init__(self, real, partial: bool = False) -> None:
        self.real, self.partial = real, partial
        self.armed = self.fired = self.halfway = False

    def __call__(self, objs, timeout=None):
        ready = self.real(objs, timeout)
        conns = [o for o in ready if isinstance(o, Connection)]
        if self.armed and not self.fired and conns:
            if self.partial and not self.halfway:
                self.halfway = True
                return conns[:1]
            self.fired = True
            raise KeyboardInterrupt
        return ready


def _arm_after(monkeypatch, cls, method: str, count: int, hook, attr: str = "_send_all") -> None:
    """Arm ``hook`` once ``cls.<attr>`` has sent ``method`` ``count`` times."""
    real, n = getattr(cls, attr), [0]

    def sending(self, m, *args):
        out = real(self, m, *args)
        n[0] += m == method
        if n[0] == count:
            hook.armed = True
        return out
    monkeypatch.setattr(cls, attr, sending)


def _count_hook(monkeypatch, obj, name: str, count: int):
    """Make ``obj.<name>`` raise KeyboardInterrupt on its ``count``-th call."""
    real, n = getattr(obj, name), [0]

    class Hook:
        fired = False

    def call(*args, **kwargs):
        n[0] += 1
        if n[0] == count:
            Hook.fired = True
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    monkeypatch.setattr(obj, name, call)
    return Hook


def test_defer_sigint_holds_ctrl_c_until_the_block_ends():
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    reached = False
    with pytest.raises(KeyboardInterrupt):
        with defer_sigint():
            _thread.interrupt_main()
            time.sleep(0.01)  # (the handler runs here)
            reached = True
    assert reached
    with pytest.raises(KeyboardInterrupt):  # a second one goes through at once
        with defer_sigint():
            _thread.interrupt_main()
            time.sleep(0.01)
            _thread.interrupt_main()
            time.sleep(0.01)
            pytest.fail("the second interrupt was held too")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("which,partial,at", [("tp_sync", False, 3), ("tp_sync", True, 5), ("tp_async", False, 4),
                                              ("tp_async", True, 6), ("tp_worker_sampling", False, 5)])
def test_tp_recovers_from_an_interrupt_while_waiting_for_a_step(request, monkeypatch, which, partial, at):
    """Interrupted while the workers' answer to a step is ready and unread (with
    ``partial``: rank 0's answer read, rank 1's not); async: a later step already sent and
    waiting for its tokens."""
    m = request.getfixturevalue(which)
    hook = _WaitHook(mp_mod.mp_wait, partial)
    monkeypatch.setattr(mp_mod, "mp_wait", hook)
    _arm_after(monkeypatch, mp_mod.MultiprocExecutor, "execute", at, hook)
    m.interrupted(hook)
    monkeypatch.undo()
    m.check_recovered(f"{which} partial={partial} at send {at}")


@pytest.mark.parametrize("where", ["sampler", "detokenizer"])
def test_async_tp_recovers_from_an_interrupt_in_driver_code(tp_async, monkeypatch, where):
    """Interrupted on the host while a step is on the workers: in the sampler (the next
    step waits for its tokens) or while detokenizing (the next step has them)."""
    eng = tp_async.llm.llm_engine
    obj, name = (eng.sampler, "sample_async") if where == "sampler" else (eng.outputs, "process_tokens")
    hook = _count_hook(monkeypatch, obj, name, 5)
    tp_async.interrupted(hook)
    monkeypatch.undo()
    tp_async.check_recovered(where)


def test_async_tp_engine_driven_without_abort_still_ends_every_request(tp_async, monkeypatch):
    """An engine driven directly (no ``LLM.generate`` to abort after the interrupt): every
    request still ends, with its full output or, for one whose token the interrupt lost,
    an error that says so; every block comes back."""
    eng = tp_async.llm.llm_engine
    hook = _WaitHook(mp_mod.mp_wait)
    monkeypatch.setattr(mp_mod, "mp_wait", hook)
    _arm_after(monkeypatch, mp_mod.MultiprocExecutor, "execute", 4, hook)
    for k, (p, sp) in enumerate(zip(PROMPTS, PARAMS)):
        eng.add_request(f"direct-{k}", p, sp)
    done, steps = {}, 0
    while eng.has_unfinished_requests() and steps < 500:
        steps += 1
        try:
            outs = eng.step()
        except KeyboardInterrupt:
            monkeypatch.undo()
            continue
        done.update((o.request_id, o) for o in outs if o.finished)
    assert hook.fired and len(done) == len(PROMPTS), f"{len(done)} of {len(PROMPTS)} ended in {steps} steps"
    errors = [o.error for o in done.values() if o.outputs[0].finish_reason == "error"]
    assert errors and all("interrupted (KeyboardInterrupt)" in e for e in errors), errors
    for k, ref in enumerate(tp_async.ref):
        o = done[f"direct-{k}"]
        if o.error is None:
            assert o.outputs[0].token_ids == ref, k
    assert eng.allocator.num_free_blocks == eng.allocator.num_blocks
    tp_async.check_recovered("driven directly")


def test_tp_ctrl_c_while_a_step_is_written_lands_after_the_whole_message(tp_sync, monkeypatch):
    """A SIGINT while rank 0's copy of a step is written: the step still reaches rank 1."""
    conn0 = tp_sync.llm.llm_engine.executor.conns[0]
    real = conn0.send_bytes

    class Hook:
        fired = False

    def send_bytes(buf, *a):
        if not Hook.fired and b"execute" in bytes(buf[:64]):
            Hook.fired = True
            _thread.interrupt_main()
        return real(buf, *a)
    monkeypatch.setattr(conn0, "send_bytes", send_bytes)
    tp_sync.interrupted(Hook)
    monkeypatch.undo()
    tp_sync.check_recovered("SIGINT mid-write")


def test_tp_torn_message_is_a_clear_error_not_a_hang(monkeypatch):
    """An interrupt that escapes half way through a step's message (a second Ctrl-C): the
    replica cannot be resynchronized, so the next call fails at once, saying so."""
    m = _Llm(tensor_parallel_size=2)
    try:
        _count_hook(monkeypatch, m.llm.llm_engine.executor.conns[1], "send_bytes", 2)  # rank 0 got that step
        with pytest.raises(KeyboardInterrupt):
            m.generate()
        monkeypatch.undo()
        outs = m.llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        for o in outs:
            assert o.outputs[0].finish_reason == "error"
            assert "part of a message" in o.error and "rebuild the engine" in o.error, o.error
        a = m.llm.llm_engine.allocator
        assert a.num_free_blocks == a.num_blocks
    finally:
        _shutdown(m.llm)


@pytest.mark.parametrize("method,at", [("step", 3), ("add", 2)])
def test_dp_recovers_from_an_interrupt_while_waiting_for_a_replica(dp, monkeypatch, method, at):
    """Interrupted while a replica's answer (to a step, or to an add: the request is
    routed but the front end never read that it was accepted) is ready and unread."""
    hook = _WaitHook(replicas_mod.mp_wait)
    monkeypatch.setattr(replicas_mod, "mp_wait", hook)
    _arm_after(monkeypatch, replicas_mod._ProcReplica, method, at, hook, attr="submit")
    dp.interrupted(hook)
    monkeypatch.undo()
    dp.check_recovered(f"dp {method}")
    assert all(dp.llm.llm_engine.alive)


def test_dp_torn_message_retires_only_that_replica(monkeypatch):
    """A message to replica 0 torn by an interrupt: that replica is retired when next used
    (its requests end with an error), the other one serves everything, correctly."""
    m = _Llm(data_parallel_size=2)
    try:
        conn0 = m.llm.llm_engine.replicas[0].conn
        _count_hook(monkeypatch, conn0, "send_bytes", 3)
        with pytest.raises(KeyboardInterrupt):
            m.generate()
        monkeypatch.undo()
        m.check_recovered("dp torn")  # every request now goes to replica 1
        assert m.llm.llm_engine.alive == [False, True]
    finally:
        _shutdown(m.llm)
