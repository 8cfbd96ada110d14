"""Speculative decoding, unit level (no model): the rejection sampler is lossless, and
fails measurably without its correction step; greedy verification; per-position
logits processing; seeded reproducibility; the n-gram proposer; KV rollback in the
allocator and the scheduler; the adaptive rule.

Random p and q are fresh draws each run (seed printed and in assertion messages).
"""
from __future__ import annotations

import random

import pytest
import torch

from helpers import urandom_seed
from kvforge import SamplingParams
from kvforge.config import SpeculativeConfig
from kvforge.engine import rejection_sampler as rs
from kvforge.engine.request import Request, RequestStatus
from kvforge.engine.sampler import Sampler
from kvforge.engine.spec_decode import AdaptiveSpeculation, SpecStats
from kvforge_plugins.kv_cache.paged import PagedAllocator
from kvforge_plugins.schedulers.chunked_prefill import ChunkedPrefillScheduler
from kvforge_plugins.spec_decode.ngram import NgramDrafter, NgramSettings

V = 8
N = 100_000       # sampled rounds per distribution check
TV_BOUND = 0.012  # the TV estimate of a correct sampler is ~0.0035 +- 0.001 at N


def _tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    emp = counts.double() / counts.sum()
    return 0.5 * (emp - p.double()).abs().sum().item()


def _dirichlet(g: torch.Generator, rows: int) -> torch.Tensor:
    """Rows drawn uniformly from the probability simplex (Dirichlet(1, ..., 1))."""
    x = torch.empty(rows, V, dtype=torch.float64).exponential_(generator=g)
    return (x / x.sum(dim=-1, keepdim=True)).float()


def _broken_tv(p: torch.Tensor, q: torch.Tensor, mode: str) -> float:
    """Analytic TV from p of the first emitted token when the correction samples from ``mode``."""
    m = torch.minimum(p, q)
    r = m.sum()
    out = m + (1 - r) * (p if mode == "target" else q)
    return 0.5 * (out - p).abs().sum().item()


def _pick_pq(seed: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random p (k + 1 positions) and q (k positions) whose first position separates the
    broken variants clearly from the correct one."""
    g = torch.Generator().manual_seed(seed)
    while True:
        p, q = _dirichlet(g, k + 1), _dirichlet(g, k)
        if min(_broken_tv(p[0], q[0], "target"), _broken_tv(p[0], q[0], "draft")) > 0.06:
            return p, q


def _run_rounds(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor, seed: int):
    """N independent rounds with the same p/q; returns (tokens per round, num_accepted)."""
    n, k = drafts.shape
    target = p.unsqueeze(0).expand(n, k + 1, V).reshape(-1, V)
    g = torch.Generator().manual_seed(seed)
    dprobs = [q] * n if q is not None else [None] * n
    return rs.rejection_sample(target, drafts.tolist(), dprobs, None, g)


def _position_counts(tokens: list[list[int]], pos: int) -> torch.Tensor:
    ids = torch.tensor([t[pos] for t in tokens if len(t) > pos])
    return torch.bincount(ids, minlength=V)


@pytest.mark.parametrize("k", [1, 3])
def test_rejection_sampler_preserves_target_distribution(k):
    seed = urandom_seed()
    p, q = _pick_pq(seed, k)
    g = torch.Generator().manual_seed(seed + 1)
    drafts = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=g) for j in range(k)], dim=1)
    tokens, acc = _run_rounds(p, q, drafts, seed + 2)
    assert all(len(t) == a + 1 for t, a in zip(tokens, acc))
    tv0 = _tv(_position_counts(tokens, 0), p[0])
    assert tv0 < TV_BOUND, f"seed {seed}: first token TV {tv0:.4f} >= {TV_BOUND}"
    # The second token exists when draft 1 was accepted, an event of position 1's coins only;
    # p does not depend on the context here, so it must follow p[1].
    tv1 = _tv(_position_counts(tokens, 1), p[1])
    assert tv1 < 1.5 * TV_BOUND, f"seed {seed}: second token TV {tv1:.4f}"
    # Acceptance probability of draft 1 is sum(min(p, q)) (Leviathan et al., Lemma 3.3).
    rate = sum(1 for a in acc if a >= 1) / N
    assert abs(rate - torch.minimum(p[0], q[0]).sum().item()) < 0.01, f"seed {seed}"


def test_rejection_sampler_deterministic_drafts():
    """n-gram-style drafts: q is one-hot on a fixed token; the output still follows p."""
    seed = urandom_seed()
    g = torch.Generator().manual_seed(seed)
    p = _dirichlet(g, 3)
    drafts = torch.tensor([[int(p[0].argmax()), int(p[1].argmin())]]).expand(N, 2)
    tokens, acc = _run_rounds(p, None, drafts, seed + 1)
    tv0 = _tv(_position_counts(tokens, 0), p[0])
    assert tv0 < TV_BOUND, f"seed {seed}: TV {tv0:.4f}"
    assert abs(sum(1 for a in acc if a >= 1) / N - p[0].max().item()) < 0.01


@pytest.mark.parametrize("mode", ["target", "draft"])
def test_distribution_bound_fails_without_correction(monkeypatch, mode):
    """Replacing the correction max(0, p - q) by p or by q breaks the bound: the test has power."""
    seed = urandom_seed()
    k = 2
    p, q = _pick_pq(seed, k)
    g = torch.Generator().manual_seed(seed + 1)
    drafts = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=g) for j in range(k)], dim=1)
    tokens, _ = _run_rounds(p, q, drafts, seed + 2)
    assert _tv(_position_counts(tokens, 0), p[0]) < TV_BOUND, f"seed {seed}: the correct sampler fails"
    monkeypatch.setattr(rs, "_recovered_distribution",
                        (lambda p_, q_: p_.clone()) if mode == "target" else (lambda p_, q_: q_.clone()))
    tokens, _ = _run_rounds(p, q, drafts, seed + 2)
    tv = _tv(_position_counts(tokens, 0), p[0])
    expected = _broken_tv(p[0], q[0], mode)
    assert tv > 3 * TV_BOUND, f"seed {seed}: sampling from {mode} on rejection went unnoticed (TV {tv:.4f})"
    assert abs(tv - expected) < 0.015, f"seed {seed}: TV {tv:.4f} vs analytic {expected:.4f}"


def _req(rid: str, sp: SamplingParams, prompt=(1, 5, 9), outputs=(), gen=None) -> Request:
    r = Request(rid, list(prompt), sp, sp.max_tokens or 100, frozenset({2}), generator=gen)
    r.output_token_ids = list(outputs)
    r.status = RequestStatus.RUNNING
    return r


def test_rejection_sampler_class_matches_processed_distribution():
    """Through RejectionSampler: p is the sampler's processed distribution (temperature,
    top-k, top-p), one-hot and model drafts alike."""
    seed = urandom_seed()
    g = torch.Generator().manual_seed(seed)
    vocab, n = 16, 40_000
    logits = torch.randn(2, vocab, generator=g) * 2
    sp = SamplingParams(temperature=0.7, top_k=10, top_p=0.9, max_tokens=50)
    ref = rs.warp_to_probs(logits[:1], [sp])[0]
    q = torch.softmax(torch.randn(vocab, generator=g), dim=-1)
    draft = torch.multinomial(q, n, replacement=True, generator=g).tolist()
    reqs = [_req(f"r{i}", sp) for i in range(n)]
    sampler = rs.RejectionSampler(vocab, torch.Generator().manual_seed(seed + 1))
    out = sampler(logits.repeat(n, 1), reqs, [[d] for d in draft], [q.unsqueeze(0)] * n)
    first = torch.bincount(torch.tensor([t[0] for t in out.token_ids]), minlength=vocab)
    emp = first.double() / n
    tv = 0.5 * (emp - ref.double()).abs().sum().item()
    assert tv < 0.03, f"seed {seed}: TV {tv:.4f}"
    assert (first[ref == 0] == 0).all(), "a token removed by top-k/top-p was emitted"
    assert all(len(lp) == len(t) for lp, t in zip(out.sampled_logprobs, out.token_ids))


def _sequential_greedy(logits: torch.Tensor, req: Request) -> list[int]:
    """What non-speculative greedy decoding picks from these rows, appending each token."""
    sampler = Sampler(logits.shape[1])
    clone = _req("seq", req.sampling_params, req.prompt_token_ids, req.output_token_ids)
    out = []
    for row in logits:
        tok = sampler(row.unsqueeze(0), [clone]).sampled_token_ids[0]
        out.append(tok)
        clone.output_token_ids.append(tok)
    return out


def test_greedy_verification_sees_drafts_in_context():
    """Penalties and min_tokens at draft position j use the output plus drafts[:j]."""
    seed = urandom_seed()
    g = torch.Generator().manual_seed(seed)
    vocab, k = 12, 4
    sp = SamplingParams(temperature=0, repetition_penalty=3.0, frequency_penalty=1.5, min_tokens=3,
                        max_tokens=50)
    base = torch.randn(vocab, generator=g)
    logits = (base + 0.3 * torch.randn(k + 1, vocab, generator=g)).abs()  # repeated favourites
    req = _req("g", sp, outputs=[3])
    seq = _sequential_greedy(logits, req)
    vs = rs.RejectionSampler(vocab)
    out = vs(logits, [req], [seq[:k]], [None])
    assert out.token_ids[0] == seq and out.num_accepted[0] == k, f"seed {seed}"
    wrong = list(seq[:k])
    wrong[2] = (wrong[2] + 1) % vocab
    out = vs(logits, [req], [wrong], [None])
    assert out.num_accepted[0] == 2 and out.token_ids[0] == seq[:3], f"seed {seed}"
    # Raw logprobs of each emitted token, as the sampler reports them.
    lp = torch.log_softmax(logits, dim=-1)
    for j, t in enumerate(out.token_ids[0]):
        assert abs(out.sampled_logprobs[0][j] - lp[j, t].item()) < 1e-5


def test_seeded_verification_is_reproducible_and_batch_independent():
    seed = urandom_seed()
    g = torch.Generator().manual_seed(seed)
    vocab, k = 32, 3
    logits = torch.randn(k + 1, vocab, generator=g)
    q = torch.softmax(torch.randn(k, vocab, generator=g), dim=-1)
    drafts = [int(t) for t in torch.multinomial(q, 1, generator=g).squeeze(1)]
    sp = SamplingParams(temperature=1.0, seed=7, max_tokens=50)

    def run(extra: int):
        reqs = [_req("s", sp, gen=torch.Generator().manual_seed(7))]
        rows, ds, qs = [logits], [drafts], [q]
        for i in range(extra):
            reqs.append(_req(f"o{i}", SamplingParams(temperature=1.0, max_tokens=50)))
            rows.append(torch.randn(k + 1, vocab))
            ds.append(drafts)
            qs.append(q)
        vs = rs.RejectionSampler(vocab, torch.Generator().manual_seed(extra))
        return vs(torch.cat(rows), reqs, ds, qs).token_ids[0]

    first = run(0)
    assert run(0) == first and run(3) == first, f"seed {seed}"


# --- n-gram proposer ---------------------------------------------------------------------------

def _brute_ngram(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    for n in range(hi, lo - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for e in range(len(tokens) - 1, n - 1, -1):  # most recent earlier occurrence ending at e
            if tokens[e - n:e] == suffix:
                out = []
                for j in range(k):  # what followed, continuing periodically past the end
                    out.append(tokens[e + j] if e + j < len(tokens) else out[j - (len(tokens) - e)])
                return out
    return []


def test_ngram_proposer_matches_brute_force_incrementally():
    seed = urandom_seed()
    rng = random.Random(seed)
    lo, hi, k = 2, 4, 5
    d = NgramDrafter(k, NgramSettings(prompt_lookup_min=lo, prompt_lookup_max=hi))
    req = _req("n", SamplingParams(max_tokens=400), prompt=[rng.randrange(6) for _ in range(20)])
    for step in range(150):
        got = d.propose([req], [k]).token_ids.get("n", [])
        want = _brute_ngram(req.all_token_ids, k, lo, hi)
        assert got == want, f"seed {seed} step {step}"
        req.output_token_ids.extend(rng.randrange(6) for _ in range(rng.randint(1, 4)))
    d.free(req)
    assert not d._index


def test_ngram_proposes_longest_most_recent_match():
    d = NgramDrafter(3, NgramSettings(prompt_lookup_min=1, prompt_lookup_max=3))
    req = _req("n", SamplingParams(), prompt=[5, 6, 7, 8, 1, 6, 7, 9, 4, 5, 6, 7])
    # "5 6 7" (n=3) occurs at the start: its continuation beats the more recent "6 7" -> 9.
    assert d.propose([req], [3]).token_ids["n"] == [8, 1, 6]
    loop = _req("l", SamplingParams(), prompt=[9, 4, 7, 4, 7])
    assert d.propose([loop], [5]).token_ids["l"] == [4, 7, 4, 7, 4]  # a loop is copied past the end
    with pytest.raises(ValueError):
        NgramSettings(prompt_lookup_min=4, prompt_lookup_max=2)


# --- KV rollback -------------------------------------------------------------------------------

def test_allocator_lookahead_never_registered_and_free_tail():
    alloc = PagedAllocator(16, 4, enable_prefix_caching=True)
    r = _req("a", SamplingParams(temperature=0, max_tokens=50), prompt=list(range(10, 17)))  # 7 tokens
    assert alloc.allocate_slots(r, 7) is not None
    r.num_computed_tokens = 7
    r.output_token_ids = [40]                        # 8 tokens; the 8th has no KV yet
    assert alloc.allocate_slots(r, 1, num_lookahead_tokens=5) is not None  # slots for 13 tokens
    assert len(alloc.get_block_table("a")) == 4
    assert alloc.num_cached_blocks == 2              # only blocks full of real tokens
    alloc.free_tail(r, 9)                            # 1 draft accepted: KV of 9 tokens is valid
    assert len(alloc.get_block_table("a")) == 3 and alloc.num_free_blocks == 13
    assert alloc.num_cached_blocks == 2
    alloc.free(r)
    assert alloc.num_free_blocks == 16


def test_scheduler_update_accepts_rolls_back_and_truncates():
    alloc = PagedAllocator(32, 4)
    sched = ChunkedPrefillScheduler(8, 64, 128, alloc)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    r = Request("x", [1, 2, 3, 4, 5], sp, 4, frozenset({2}))
    sched.add_request(r)
    so = sched.schedule()
    sched.update(so, {"x": [7]})                     # prefill -> first token
    r.spec_token_ids = [8, 9, 10]
    so = sched.schedule()
    assert so.num_scheduled_tokens["x"] == 4 and so.spec_token_ids["x"] == [8, 9, 10]
    assert len(alloc.get_block_table("x")) == 3      # 6 tokens + 3 lookahead = 9 slots
    sched.update(so, {"x": [8, 11]})                 # one accepted, then the target's token
    assert r.output_token_ids == [7, 8, 11] and r.num_computed_tokens == 7
    assert len(alloc.get_block_table("x")) == 2 and not r.spec_token_ids
    r.spec_token_ids = [12, 13]
    so = sched.schedule()
    sched.update(so, {"x": [12, 13, 14]})            # all accepted, but max_tokens=4 cuts after 12
    assert r.output_token_ids == [7, 8, 11, 12] and r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert alloc.num_free_blocks == alloc.num_blocks


def test_scheduler_trims_drafts_to_the_token_budget():
    alloc = PagedAllocator(32, 4)
    sched = ChunkedPrefillScheduler(8, 3, 128, alloc)  # 3 tokens per step
    a = Request("a", [1, 2], SamplingParams(temperature=0, max_tokens=9), 9)
    sched.add_request(a)
    sched.update(sched.schedule(), {"a": [5]})
    a.spec_token_ids = [6, 7, 8, 9]
    so = sched.schedule()
    assert so.spec_token_ids["a"] == [6, 7] and so.total_num_scheduled_tokens == 3


# --- adaptive rule -------------------------------------------------------------------------------

def test_adaptive_rule():
    cfg = SpeculativeConfig(method="x", num_speculative_tokens=4)
    ngram = AdaptiveSpeculation(4, cfg, relative_cost=0.0)
    assert ngram.choose(1) == 4                      # drafts are free, verify is memory-bound
    ngram.acceptance = 0.05
    assert ngram.choose(64) < 4                      # 64 x 5 tokens is past the memory-bound zone
    assert ngram.choose(512) == 0
    ngram.acceptance = 0.9
    assert ngram.choose(64) == 1 and ngram.choose(16) == 4  # 64 x 2 tokens fill the free zone
    selfdraft = AdaptiveSpeculation(4, cfg, relative_cost=1.0)
    selfdraft.acceptance = 1.0
    assert selfdraft.choose(1) == 0                  # a draft as costly as the target never pays
    small = AdaptiveSpeculation(4, cfg, relative_cost=0.1)
    small.acceptance = 0.8
    assert small.choose(1) >= 3
    small.acceptance = 0.1
    picks = [small.choose(1) for _ in range(2 * small.PROBE_INTERVAL)]
    assert picks.count(1) == 2 and picks.count(0) == len(picks) - 2  # off, with a cheap probe now and then
    small.observe(64, 60)                            # the probe finds matches again: on
    assert small.choose(1) >= 3
    selfdraft.acceptance = 0.0
    assert all(selfdraft.choose(1) == 0 for _ in range(200))  # never probes what can never pay
    rare = AdaptiveSpeculation(4, cfg, relative_cost=0.0)
    rare.acceptance = 0.1
    assert rare.choose(1) == 0        # E(1) = 1.1 tokens do not pay for a synchronous verifying step
    free = AdaptiveSpeculation(4, SpeculativeConfig(method="x", num_speculative_tokens=4, step_overhead=0.0), 0.0)
    free.acceptance = 0.1
    assert free.choose(1) == 4        # ... if that step cost nothing extra, any draft would pay
    fixed = AdaptiveSpeculation(4, SpeculativeConfig(method="x", num_speculative_tokens=4, adaptive=False,
                                                     disable_by_batch_size=8), 1.0)
    assert fixed.choose(8) == 4 and fixed.choose(9) == 0
    st = SpecStats()
    st.record(3, 1)
    st.record(2, 2)
    m = st.metrics()
    assert m["spec_acceptance_rate"] == 3 / 5 and m["spec_mean_accepted_length"] == 2.5
    assert m["spec_acceptance_rate_pos_0"] == 1.0 and m["spec_acceptance_rate_pos_2"] == 0.0


def test_coupled_verification_emits_the_target_distribution():
    """Seeded requests' verification (position-keyed noise): over many seeds the emitted
    first token follows p_1 (TV bound), with independent or coupled drafts. An independent
    first draft is accepted with probability sum_x p_1(x) q_1(x); a coupled one (the same
    exponential-race noise for draft and target) at least (1 - d) / (1 + d), d = TV(p_1, q_1),
    the Gumbel-coupling bound (Daliri et al. 2024, "Coupling without communication")."""
    import types

    from kvforge.engine.position_noise import position_seed
    from kvforge.engine.rejection_sampler import coupled_verify
    from kvforge.engine.sampling_ops import exponential_race_sample

    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    v, k, trials = 6, 2, 4000
    p = torch.softmax(torch.randn(k + 1, v, generator=g) * 1.5, dim=-1)
    q = torch.softmax(torch.log(p) + 0.3 * torch.randn(k + 1, v, generator=g), dim=-1)[:k]
    counts = torch.zeros(v)
    first_coupled = first_indep = 0
    base = random.randrange(1 << 30)
    for s in range(trials):
        req = types.SimpleNamespace(sampling_params=types.SimpleNamespace(seed=base + s), index=0,
                                    output_token_ids=[], generator=torch.Generator())
        coupled = exponential_race_sample(q, [req.generator] * k, None,
                                          [position_seed(req, j) for j in range(k)]).tolist()
        indep = torch.multinomial(q, 1, generator=g).flatten().tolist()
        (toks, a), = coupled_verify(p, [req], [coupled])
        (toks_i, a_i), = coupled_verify(p, [req], [indep])
        assert toks_i[0] == toks[0]  # the emitted token does not depend on the drafts
        counts[toks[0]] += 1
        first_coupled += a >= 1
        first_indep += a_i >= 1
    tv = 0.5 * (counts / trials - p[0]).abs().sum().item()
    assert tv < 0.04, f"TV {tv:.3f} between emitted tokens and p_1"
    sigma = (0.25 / trials) ** 0.5  # std of an acceptance rate, at most
    indep = (p[0] * q[0]).sum().item()
    assert abs(first_indep / trials - indep) < 5 * sigma, (first_indep / trials, indep)
    d = 0.5 * (p[0] - q[0]).abs().sum().item()
    assert first_coupled / trials > (1 - d) / (1 + d) - 5 * sigma, (first_coupled / trials, d)
    # and the shared noise is what does it: coupled beats independent wherever the bound says so
    if (1 - d) / (1 + d) > indep + 10 * sigma:
        assert first_coupled > first_indep, (first_coupled, first_indep)
