"""The CPU-side rules of ``benchmarks/w4_cold_tune.py`` (the cold-L2 tuner of the int4 mma
GEMM): every candidate it would time is a launchable config at its M, none is timed twice,
the shipped table's same-M entries are among them, and a finalist replaces the table's entry
only when it beats the current config by the margin."""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import w4_cold_tune  # noqa: E402
from kvforge_plugins.quant.kernels import w4_mma  # noqa: E402
from kvforge_plugins.quant.kernels.choices import table_path  # noqa: E402
from kvforge_plugins.quant.kernels.w4_mma_config import check_config  # noqa: E402

GPU = "NVIDIA H200"  # the shipped table's GPU


@pytest.mark.parametrize("m", [1, 16, 32, 64])
def test_candidates_launch_and_are_distinct(m):
    cands = w4_cold_tune.candidates(m, GPU)
    assert len(cands) > 20
    full = [{**w4_mma.CONFIGS[w4_mma.bucket(m)], **c} for c in cands]
    for cfg in full:
        check_config(cfg, m)  # raises for a config that cannot launch or does not cover M
    tags = [json.dumps(cfg, sort_keys=True) for cfg in full]
    assert len(set(tags)) == len(tags)


@pytest.mark.parametrize("m", [1, 16, 64])
def test_candidates_hold_the_tables_same_m_entries(m):
    table = json.loads(Path(table_path()).read_text())[GPU]["w4_mma"]
    rows = [e for key, e in table.items() if int(key.split("|")[0]) == m]
    assert rows
    base = w4_mma.CONFIGS[w4_mma.bucket(m)]
    got = {json.dumps({**base, **c}, sort_keys=True) for c in w4_cold_tune.candidates(m, GPU)}
    for e in rows:
        assert json.dumps({**base, **{k: v for k, v in e.items() if k != "schema"}}, sort_keys=True) in got


def _grid_beyond_table(m: int, grid: str) -> list[dict]:
    """The full configs ``--grid grid`` times at M, less the table's same-M rows; checks that the
    full grid holds every one of them."""
    base = w4_mma.CONFIGS[w4_mma.bucket(m)]
    sub = [{**base, **c} for c in w4_cold_tune.candidates(m, GPU, grid=grid)]
    full = {json.dumps({**base, **c}, sort_keys=True) for c in w4_cold_tune.candidates(m, GPU)}
    assert all(json.dumps(c, sort_keys=True) in full for c in sub)
    table = json.loads(Path(table_path()).read_text())[GPU]["w4_mma"]
    rows = {json.dumps({**base, **{k: v for k, v in e.items() if k != "schema"}}, sort_keys=True)
            for key, e in table.items() if int(key.split("|")[0]) == m}
    return [c for c in sub if json.dumps(c, sort_keys=True) not in rows]


@pytest.mark.parametrize("m", [1, 16, 64])
def test_small_cta_grid_is_part_of_the_full_grid(m):
    # --grid small-ctas times the small-CTA tilings (<= 2 tiles, 2-8 warps all splitting K) and
    # the table's same-M rows; the full grid holds all of them. At M > 16 the grid is empty.
    grid = _grid_beyond_table(m, "small-ctas")
    if m > 16:
        assert grid == []
    else:
        assert len(grid) > 100
        assert all(c["TW"] <= 2 and c["WARPS"] <= 8 and c["KW"] == c["WARPS"] for c in grid)
        # splits of 2..8 sum in a cluster (its portable size), more through global memory
        assert {(c["split_k"], c["CLU"]) for c in grid} == {(1, 0), (2, 1), (4, 1), (8, 1), (4, 0), (8, 0), (16, 0)}
        assert {c["MINB"] for c in grid} == {1, 4}
    with pytest.raises(ValueError, match="grid must be one of"):
        w4_cold_tune.candidates(m, GPU, grid="small")


@pytest.mark.parametrize("m", [1, 16, 64])
def test_xs_deep_grid_is_part_of_the_full_grid(m):
    # --grid xs-deep: register pipelines S 2..6 with x in shared memory, which no other M <= 16
    # grid has (they all keep XS 0)
    grid = _grid_beyond_table(m, "xs-deep")
    if m > 16:
        assert grid == []
    else:
        assert len(grid) > 100
        assert all(c["XS"] == 1 and c["CPA"] == 0 for c in grid)
        assert {c["S"] for c in grid} == {2, 3, 4, 6}
        assert not any(c.get("XS") for c in _grid_beyond_table(m, "small-ctas"))


@pytest.mark.parametrize("m", [1, 16, 64])
def test_columns_grid_is_part_of_the_full_grid(m):
    # --grid cols: CTAs of 2 or 4 columns of warps (WARPS / KW) sharing x, on the CUR 1 register
    # path, with and without x in shared memory
    grid = _grid_beyond_table(m, "cols")
    if m > 16:
        assert grid == []
    else:
        assert len(grid) > 100
        assert all(c["CUR"] == 1 and c["CPA"] == 0 for c in grid)
        assert {c["WARPS"] // c["KW"] for c in grid} == {2, 4}
        assert {c["XS"] for c in grid} == {0, 1}


@pytest.mark.parametrize("m", [1, 16, 64])
def test_wst_grid_is_part_of_the_full_grid(m):
    # --grid wst: WG 2 configs with their consumers in trips of CPA chunks, at the config's MINB
    # and at 4 CTAs per SM
    # (an even CPA: WST's trips alternate two fragment buffers; MINB 4 only where 4 CTAs of 5
    # warps are what it asks)
    grid = _grid_beyond_table(m, "wst")
    assert len(grid) >= 4
    assert all(c["WG"] == 2 and c["WST"] == 1 and c["CPA"] % 2 == 0 for c in grid)
    assert all(c["WARPS"] == 4 for c in grid if c["MINB"] == 4)
    assert 4 in {c["MINB"] for c in grid} and len({c["MINB"] for c in grid}) > 1


def test_prenorm_candidates_are_the_kernels_it_has():
    # the RMSNorm-prologue kernel keeps x in shared memory: no XR ring, no warpgroup MMAs, and
    # XS 0 / 1 are one kernel; its own table rows are among the candidates
    plain = w4_cold_tune.candidates(1, GPU)
    pre = w4_cold_tune.candidates(1, GPU, prenorm=True)
    assert any(c.get("WG") or c.get("XR") for c in plain)
    assert not any(c.get("WG") or c.get("XR") for c in pre)
    base = w4_mma.CONFIGS[w4_mma.bucket(1)]
    tags = [json.dumps({**base, **c, "XS": 1}, sort_keys=True) for c in pre]
    assert len(set(tags)) == len(tags) < len(plain)
    rows = json.loads(Path(table_path()).read_text())[GPU].get(w4_mma.PRENORM_KIND, {})
    assert rows
    got = {json.dumps({**base, **c, "XS": 1}, sort_keys=True) for c in pre}
    for e in rows.values():
        assert json.dumps({**base, **{k: v for k, v in e.items() if k != "schema"}, "XS": 1}, sort_keys=True) in got


def test_a_finalist_replaces_the_entry_only_past_the_margin():
    cur = random.uniform(5e-6, 50e-6)
    # 1% faster: the fastest finalist, but within a 2% margin, so the table keeps its entry
    best, won = w4_cold_tune.pick({"current": [cur, cur], "#0": [cur * 0.99] * 2, "#1": [cur * 1.1] * 2}, 0.02)
    assert (best, won) == ("#0", False)
    # 3% faster on the mean of two rounds: it wins
    best, won = w4_cold_tune.pick({"current": [cur, cur], "#0": [cur * 1.05] * 2,
                                   "#1": [cur * 0.96, cur * 0.98]}, 0.02)
    assert (best, won) == ("#1", True)
    # slower than the current config: never
    assert w4_cold_tune.pick({"current": [cur], "#0": [cur * 1.01]}, 0.0) == ("#0", False)
    assert w4_cold_tune.pick({"current": [cur]}, 0.02) == (None, False)


@pytest.mark.parametrize("m", [1, 16, 64])
def test_cur_grid_twins_the_register_path_configs(m):
    # --grid cur: each register-path config (CPA 0, no x ring) of the full grid with CUR 1, which
    # the full grid also holds; configs with CPA stages have no twin (CUR needs CPA 0)
    grid = _grid_beyond_table(m, "cur")
    assert grid and all(c.get("CUR") == 1 and not c.get("CPA") and not c.get("XR") for c in grid)
    base = w4_mma.CONFIGS[w4_mma.bucket(m)]
    full = [{**base, **c} for c in w4_cold_tune.candidates(m, GPU)]
    plain = {json.dumps({**c, "CUR": 1}, sort_keys=True) for c in full if not c.get("CUR") and not c.get("CPA")
             and not c.get("XR")}
    assert {json.dumps(c, sort_keys=True) for c in grid} <= plain
    assert any(c.get("CPA") for c in full)
