"""Which decode batch sizes are captured as CUDA graphs (``model.cuda_graph_sizes``).

The capture itself needs a GPU (tests/test_gpu_backends.py replays graphs against eager
runs); the size rule and the option's validation are host-side and tested here.
"""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from helpers import STORIES_MODEL, fresh_rng
from kvforge import EngineConfig
from kvforge.engine.cuda_graphs import capture_sizes


def test_default_is_vllms_pattern_up_to_max_batch():
    assert capture_sizes(None, 256) == (1, 2, 4) + tuple(range(8, 257, 8))
    assert capture_sizes(None, 4) == (1, 2, 4)
    assert capture_sizes(None, 20) == (1, 2, 4, 8, 16, 20)  # the largest batch is always captured


def test_any_batch_pads_by_fewer_than_8_rows():
    rng = fresh_rng("graph-sizes")
    max_batch = rng.randint(9, 512)
    sizes = capture_sizes(None, max_batch)
    for n in range(1, max_batch + 1):
        padded = min(s for s in sizes if s >= n)
        assert padded - n < 8, (n, padded, max_batch)


def test_one_value_caps_the_pattern_and_a_list_is_taken_as_is():
    # as vLLM: batches above the largest size run eagerly (not padded up to max_num_seqs)
    assert capture_sizes(64, 256) == (1, 2, 4) + tuple(range(8, 65, 8))
    assert capture_sizes(20, 256) == (1, 2, 4, 8, 16, 20)
    assert capture_sizes(1000, 128) == capture_sizes(None, 128)
    assert capture_sizes([1, 3, 200, 999], 256) == (1, 3, 200)


@pytest.mark.parametrize("value", [0, -8, [], [4, 0], True, [8, True], 2.5, "64"])
def test_bad_sizes_refused_naming_the_field(value):
    with pytest.raises(ValidationError, match=r"model\.cuda_graph_sizes"):
        EngineConfig.from_sources(None, {"model": STORIES_MODEL, "cuda_graph_sizes": value})


def test_flat_option_and_list():
    cfg = EngineConfig.from_sources(None, {"model": STORIES_MODEL, "cuda_graph_sizes": [1, 8, 64]})
    assert cfg.model.cuda_graph_sizes == [1, 8, 64]
    assert EngineConfig.from_sources(None, {"model": STORIES_MODEL, "cuda_graph_sizes": 32}).model.cuda_graph_sizes == 32


def test_buckets_share_one_set_of_static_inputs():
    """Every bucket reads a leading slice of one max-size buffer set (one block table of
    max_batch rows however many sizes are captured); a batch picks the smallest bucket that
    holds it and a larger one runs eagerly. (Built on the CPU: no capture here.)"""
    import torch

    from kvforge.engine.cuda_graphs import CudaGraphRunner
    r = CudaGraphRunner(None, None, [], max_batch=256, max_model_len=1024, block_size=16, scratch_block=7,
                        device=torch.device("cpu"))
    big = r.buckets[-1]
    assert big.size == 256 and len(r.buckets) == 35
    for b in r.buckets:
        for name in ("input_ids", "positions", "slot_mapping", "block_table", "context_lens", "seq_lens"):
            t = getattr(b, name)
            assert t.data_ptr() == getattr(big, name).data_ptr() and t.shape[0] == b.size, (b.size, name)
        assert b.inputs.query_start_loc.tolist() == list(range(b.size + 1))
    assert (big.block_table == 7).all() and (big.slot_mapping == 7 * 16).all()  # padding targets the scratch block
    assert r.bucket_for(193).size == 200 and r.bucket_for(256).size == 256 and r.bucket_for(257) is None
    none = CudaGraphRunner(None, None, [], max_batch=8, max_model_len=64, block_size=16, scratch_block=0,
                           device=torch.device("cpu"), buckets=(16, 32))
    assert none.buckets == [] and none.bucket_for(1) is None
