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
    assert capture_sizes(64, 256) == (1, 2, 4) + tuple(range(8, 65, 8)) + (256,)
    assert capture_sizes(1000, 128) == capture_sizes(None, 128)
    assert capture_sizes([1, 3, 200, 999], 256) == (1, 3, 200, 256)


@pytest.mark.parametrize("value", [0, -8, [], [4, 0]])
def test_bad_sizes_refused_naming_the_field(value):
    with pytest.raises(ValidationError, match=r"model\.cuda_graph_sizes"):
        EngineConfig.from_sources(None, {"model": STORIES_MODEL, "cuda_graph_sizes": value})


def test_flat_option_and_list():
    cfg = EngineConfig.from_sources(None, {"model": STORIES_MODEL, "cuda_graph_sizes": [1, 8, 64]})
    assert cfg.model.cuda_graph_sizes == [1, 8, 64]
    assert EngineConfig.from_sources(None, {"model": STORIES_MODEL, "cuda_graph_sizes": 32}).model.cuda_graph_sizes == 32
