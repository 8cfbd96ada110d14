"""The params table that lets the output worker sample (kvforge.distributed.worker_sampling):
handles, eviction, the worker's mirror, and that a worker samples exactly as the driver's
Sampler does (seeded noise keyed by request index and position, min_tokens, logprobs,
allowed_token_ids, one-token bad words)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvforge import SamplingParams
from kvforge.distributed.worker_sampling import ParamsTable, WorkerSampler
from kvforge.engine.request import Request
from kvforge.engine.sampler import Sampler


def _req(rid: str, sp: SamplingParams, index: int = 0, out: int = 0) -> Request:
    gen = torch.Generator().manual_seed(sp.seed + index) if sp.seed is not None else None
    r = Request(rid, [1, 2, 3], sp, sp.max_tokens, frozenset({2}), parent_id=rid, index=index, generator=gen)
    r.output_token_ids.extend([5] * out)
    return r


def test_table_sends_each_params_once_and_evicts_least_recently_used():
    a, b, c = (SamplingParams(temperature=0.5, max_tokens=9) for _ in range(3))
    t = ParamsTable(capacity=2)
    w1 = t.encode([_req("x", a), _req("y", a), _req("z", b)], [0, 1, 2])
    assert w1.handles.tolist() == [0, 0, 1] and set(w1.new) == {0, 1} and w1.drop == []
    assert w1.num_generated.tolist() == [0, 1, 2]
    w2 = t.encode([_req("z", b)], [3])
    assert w2.handles.tolist() == [1] and w2.new == {} and w2.drop == []
    w3 = t.encode([_req("u", c)], [0])  # a is least recently used: dropped
    assert w3.handles.tolist() == [2] and set(w3.new) == {2} and w3.drop == [0] and len(t) == 2
    w4 = t.encode([_req("x", a), _req("y", b), _req("u", c)], [1, 1, 1])  # a returns: new handle
    assert w4.handles.tolist() == [3, 1, 2] and set(w4.new) == {3}
    assert w4.drop == [] and len(t) == 3  # all three in this step: none may go yet


def test_worker_mirror_refuses_unknown_handles():
    ws = ParamsTable().encode([_req("x", SamplingParams(max_tokens=3))], [0])
    worker = WorkerSampler(16, torch.device("cpu"), seed=0)
    worker.update(ws)
    ws.handles = np.asarray([7], dtype=np.int64)
    with pytest.raises(RuntimeError, match="unknown params handles"):
        worker.update(ws)


def test_worker_samples_like_the_driver():
    """Same rows through the driver's Sampler and through the table + WorkerSampler, at four
    output positions. Flat logits over 1000 ids: the seeded noise decides the tokens, so a
    worker that ignored a seed, the completion index or the position would differ."""
    v = 1000
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ()).item()))
    seeded = SamplingParams(temperature=0.9, top_p=0.8, seed=1234, max_tokens=20, logprobs=3)
    allowed = SamplingParams(temperature=0.8, seed=5, max_tokens=20, allowed_token_ids=[7, 8, 9, 500])
    banned = SamplingParams(temperature=0, max_tokens=20, bad_words=["x"])
    banned._bad_words_token_ids = [[11]]  # one token: no history needed, so the row may sample on a worker
    assert not banned.reads_history
    for shift in range(4):
        logits = torch.randn(7, v, generator=g)
        reqs = [
            _req("a", SamplingParams(temperature=0, max_tokens=20), out=shift),
            _req("b", seeded, index=0, out=4 + shift),
            _req("c", seeded, index=1, out=4 + shift),                                       # n=2: other noise
            _req("d", SamplingParams(temperature=0, min_tokens=5, max_tokens=20), out=1),  # EOS (2) banned
            _req("e", SamplingParams(temperature=0.7, top_k=5, min_p=0.05, seed=9, max_tokens=20,
                                     logit_bias={3: 4.0}), out=shift),
            _req("f", allowed, out=shift),
            _req("g", banned, out=shift),
        ]
        logits[3, 2] = 50.0  # EOS would win without min_tokens
        logits[5:, 11] = 50.0  # not allowed in row f; a bad word in row g
        counts = [len(r.output_token_ids) for r in reqs]
        ref = Sampler(v, torch.Generator().manual_seed(0)).sample_async(logits.clone(), reqs, counts).result()
        ws = ParamsTable().encode(reqs, counts)
        worker = WorkerSampler(v, torch.device("cpu"), seed=0)
        worker.update(ws)
        got = worker.sample(logits.clone(), ws).result()
        assert got.sampled_token_ids == ref.sampled_token_ids, shift
        assert got.sampled_token_ids[3] != 2
        assert got.sampled_token_ids[5] in (7, 8, 9, 500) and got.sampled_token_ids[6] != 11
        assert np.allclose(got.sampled_logprobs, ref.sampled_logprobs, atol=1e-6)
    assert got.logprobs[1].keys() == ref.logprobs[1].keys()
