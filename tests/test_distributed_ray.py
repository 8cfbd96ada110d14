"""Ray backend on a local two-node cluster (``ray.cluster_utils.Cluster``, one CPU per node):

* DP=2 (``data_parallel_size=2, distributed_executor_backend="ray"``): one replica actor
  per node, each in its own placement group; every request is served, outputs equal a
  single engine's, both replicas get work, every KV block comes back on both.
* TP=2 over the two "nodes" (a placement group of two one-CPU bundles, gloo between the
  actors): greedy outputs equal TP=1.
* A replica actor killed mid-run: its requests end with an error within seconds, the
  other replica keeps serving.
"""
from __future__ import annotations

import random
import time

import pytest

ray = pytest.importorskip("ray")

from helpers import STORIES_MODEL, STORY_OPENINGS, urandom_seed  # noqa: E402
from kvforge import LLM, SamplingParams  # noqa: E402

COMMON = dict(num_gpu_blocks=96, dtype="float32", distributed_executor_backend="ray")


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=1)
    ray.init(address=c.address, log_to_driver=False)
    assert ray.cluster_resources().get("CPU") == 2
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def reference():
    seed = urandom_seed()
    rng = random.Random(seed)
    prompts = rng.sample(STORY_OPENINGS, 8)
    sp = SamplingParams(temperature=0, max_tokens=24)
    outs = LLM(model=STORIES_MODEL, num_gpu_blocks=96, dtype="float32").generate(prompts, sp, use_tqdm=False)
    return prompts, sp, [o.outputs[0].token_ids for o in outs], seed


def test_dp2_on_two_ray_nodes_serves_every_request(cluster, reference):
    prompts, sp, ref, seed = reference
    llm = LLM(model=STORIES_MODEL, data_parallel_size=2, **COMMON)
    engine = llm.llm_engine
    try:
        nodes = {info["node"] for info in engine.replica_info}
        assert len(nodes) == 2, f"the two replicas should sit on the two nodes: {engine.replica_info}"
        got = llm.generate(prompts, sp, use_tqdm=False)
        assert len(got) == len(prompts)
        for k, (g, r) in enumerate(zip(got, ref)):
            assert g.finished and g.error is None, f"prompt {k}: {g.error}"
            assert g.outputs[0].token_ids == r, f"prompt {k} {prompts[k]!r} differs from one engine (seed {seed})"
        assert sorted(engine.num_routed) == [4, 4], f"unbalanced routing: {engine.num_routed}"
        for i, st in enumerate(engine.replica_stats()):
            assert st["num_free_blocks"] == st["num_blocks"], f"replica {i} holds KV blocks"
        # A replica dies: its requests fail fast, the other replica still serves.
        long = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
        for i in range(4):
            engine.add_request(f"d{i}", prompts[i], long)
        victim = engine._owner["d0"]
        victim_rids = {rid for rid, i in engine._owner.items() if i == victim}
        for _ in range(3):
            engine.step()
        ray.kill(engine.replicas[victim].actor, no_restart=True)
        t0 = time.monotonic()
        finished = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
            assert time.monotonic() - t0 < 30
        assert set(finished) == {f"d{i}" for i in range(4)}
        failed = {rid for rid, o in finished.items() if o.error}
        assert failed == victim_rids, f"failed {failed}, on the killed replica {victim_rids}"
        assert all(f"replica {victim} died" in finished[r].error for r in failed)
        assert time.monotonic() - t0 < 10, "requests of the dead replica took too long to fail"
        [after] = llm.generate(prompts[0], sp, use_tqdm=False)
        assert after.error is None and after.outputs[0].token_ids == ref[0], "the live replica stopped serving"
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_tp2_ray_executor_across_two_nodes(cluster, reference, async_scheduling):
    """Async: an actor takes one call at a time, so the driver samples each step before it
    sends the next (placeholders resolved on the driver); outputs are the same."""
    prompts, sp, ref, seed = reference
    llm = LLM(model=STORIES_MODEL, tensor_parallel_size=2, async_scheduling=async_scheduling, **COMMON)
    engine = llm.llm_engine
    try:
        got = llm.generate(prompts[:4], sp, use_tqdm=False)
        for k, (g, r) in enumerate(zip(got, ref)):
            assert g.error is None, g.error
            assert g.outputs[0].token_ids == r, f"prompt {k} (seed {seed})"
        a = engine.allocator
        assert a.num_free_blocks == a.num_blocks
        if async_scheduling:
            assert engine._overlap.num_overlapped_steps > 0
    finally:
        engine.executor.shutdown()
