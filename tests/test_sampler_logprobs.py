"""Sampler log-probabilities (vLLM ``logprobs`` / ``prompt_logprobs`` semantics): raw
log-softmax values, 1-based ranks with ties sharing a rank, the sampled token first, padded
vocabulary columns ignored. Fresh random logits on every run."""
from __future__ import annotations

import math

import pytest
import torch

from helpers import sampler_request as _req
from kvforge.engine.outputs import Logprob
from kvforge.engine.sampler import Sampler, SamplerOutput, compute_prompt_logprobs
from kvforge.engine.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# --- 6. logprobs -------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_sample_logprobs_are_raw_and_ranked(device: str) -> None:
    v = 300
    settings = [None, 0, 1, 5, 20, 3]
    logits = torch.randn(len(settings), v, device=device) * 2
    reqs = []
    for i, k in enumerate(settings):
        # Processing that changes the distribution must not leak into returned logprobs.
        sp = SamplingParams(logprobs=k, temperature=[0.0, 0.8, 1.3][i % 3], top_k=50, top_p=0.9,
                            repetition_penalty=1.3, logit_bias={1: 3.0}, frequency_penalty=0.5)
        reqs.append(_req(f"r{i}", sp, prompt=torch.randint(0, v, (12,)).tolist(),
                         output=torch.randint(0, v, (4,)).tolist()))
    out = Sampler(v)(logits, reqs)
    assert isinstance(out, SamplerOutput)
    ref = torch.log_softmax(logits.double(), -1).cpu()
    for i, k in enumerate(settings):
        tok = out.sampled_token_ids[i]
        assert math.isclose(out.sampled_logprobs[i], float(ref[i, tok]), rel_tol=1e-5, abs_tol=1e-5)
        d = out.logprobs[i]
        if k is None:
            assert d is None
            continue
        assert tok in d and next(iter(d)) == tok
        top = ref[i].topk(k).indices.tolist() if k else []
        assert set(d) == set(top) | {tok}
        for t, lp in d.items():
            assert isinstance(lp, Logprob)
            assert math.isclose(lp.logprob, float(ref[i, t]), rel_tol=1e-5, abs_tol=1e-5)
            assert lp.rank == 1 + int((ref[i] > ref[i, t]).sum())
        assert d[tok].logprob == out.sampled_logprobs[i]
        assert sorted(d[t].rank for t in top) == list(range(1, k + 1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num", [0, 4])
def test_compute_prompt_logprobs(device: str, num: int) -> None:
    p, v = 11, 200
    logits = torch.randn(p, v, device=device) * 3
    targets = torch.randint(0, v, (p,)).tolist()
    targets[0] = int(logits[0].argmax())  # one target that is rank 1
    res = compute_prompt_logprobs(logits, targets, num)
    ref = torch.log_softmax(logits.double(), -1).cpu()
    assert len(res) == p
    for i, d in enumerate(res):
        assert next(iter(d)) == targets[i]
        assert set(d) == set(ref[i].topk(num).indices.tolist()) | {targets[i]}
        for t, lp in d.items():
            assert math.isclose(lp.logprob, float(ref[i, t]), rel_tol=1e-5, abs_tol=1e-5)
            assert lp.rank == 1 + int((ref[i] > ref[i, t]).sum())
    assert res[0][targets[0]].rank == 1
    assert compute_prompt_logprobs(logits[:0], [], num) == []


def test_ties_share_rank() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0, -1.0]])
    d = compute_prompt_logprobs(logits, [3], 4)[0]
    assert [d[t].rank for t in (1, 2, 4)] == [1, 1, 1]
    assert d[0].rank == 4 and d[3].rank == 5


def test_padded_vocab_columns_are_ignored() -> None:
    v = 32
    logits = torch.randn(3, v + 8)
    logits[:, v:] = 100.0  # padded lm_head columns must never be chosen
    reqs = [_req(f"r{i}", SamplingParams(temperature=t, logprobs=2)) for i, t in enumerate([0.0, 1.0, 1.0])]
    out = Sampler(v)(logits, reqs)
    assert all(t < v for t in out.sampled_token_ids)
    assert all(tid < v for d in out.logprobs for tid in d)
    ref = torch.log_softmax(logits[:, :v], -1)
    assert math.isclose(out.sampled_logprobs[0], float(ref[0, out.sampled_token_ids[0]]), rel_tol=1e-5)
