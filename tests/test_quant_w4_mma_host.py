"""The host side of the int4 mma GEMM (``kernels/w4_mma.py``): bad operands, groups and
launch configs refused with a clear error before any launch, the shipped choices table's
entries passing the same checks, and the table's lookup rules (the M = 1 entry serving up to
8 tokens; stages past shared memory refused). The kernel's launches are emulated on the CPU
(tests/w4_mma_emulate.py). Fresh random data each run."""
from __future__ import annotations

import pytest
import torch

from kvforge_plugins.quant.kernels import w4_mma
from kvforge_plugins.quant.kernels.w4_mma import pack_mma, pack_mma_groups
from test_quant_w4_mma import BOUND, _quant, gen  # noqa: F401  (gen: the fresh-seed fixture)


def test_gemm_refuses_bad_operands_before_launch(gen):
    q, s, z, _ = _quant(128, 64, 64, gen)
    ps, pz = pack_mma_groups(s, z)
    words = pack_mma(q)
    x = torch.randn(2, 128, generator=gen)
    with pytest.raises(ValueError, match="x dtype torch.float32 must be fp16/bf16"):
        w4_mma.mma_gemm(x, words, ps, pz, group_size=64, n=64)
    with pytest.raises(ValueError, match=r"words \(1, 1024\) do not fit"):
        w4_mma.mma_gemm(x.bfloat16(), words, ps, pz, group_size=64, n=128)
    with pytest.raises(ValueError, match="group 32"):
        w4_mma.mma_gemm(x.bfloat16(), words, ps, pz, group_size=32, n=64)
    assert w4_mma.mma_gemm(x[:0].bfloat16(), words, ps, pz, group_size=64, n=64).shape == (0, 64)


def test_gemm_refuses_bad_groups_and_configs(gen):
    q, s, z, _ = _quant(128, 64, 64, gen)
    ps, pz = pack_mma_groups(s, z)
    words = pack_mma(q)
    x = torch.randn(16, 128, generator=gen).bfloat16()
    with pytest.raises(ValueError, match="must be contiguous float16"):
        w4_mma.mma_gemm(x, words, ps.float(), pz, group_size=64, n=64)
    with pytest.raises(ValueError, match="int32 \\(2, 1, 8, 2\\)"):  # 16-bit values where the zero-point words go
        w4_mma.mma_gemm(x, words, ps, ps.view(torch.int16), group_size=64, n=64)
    with pytest.raises(ValueError, match=r"float16 \(1, 1, 8, 8\)"):
        w4_mma.mma_gemm(x, words, ps, pz, group_size=128, n=64)
    with pytest.raises(ValueError, match="does not cover M 16"):  # one token block of 8 for 16 tokens
        w4_mma.mma_gemm(x, words, ps, pz, group_size=64, n=64, config=dict(NB=1))
    with pytest.raises(ValueError, match="TW in 1/2/4"):
        w4_mma.mma_gemm(x, words, ps, pz, group_size=64, n=64, config=dict(TW=3))
    with pytest.raises(ValueError, match="CPA 0 or 2..8"):  # one stage cannot overlap anything
        w4_mma.mma_gemm(x, words, ps, pz, group_size=64, n=64, config=dict(CPA=1))
    # compile-time constants: no silent truncation (NB 1.5 would compile as 1: 8 of 12 tokens),
    # no unknown keys (a misspelling would run the default), launchable sizes only
    for bad, msg in ((dict(NB=1.5), "must be integers"), (dict(nb=2), "unknown config keys"),
                     (dict(WARPS=64), "1 <= WARPS <= 32"), (dict(split_k=-1), "split_k >= 0"),
                     (dict(XS=5), "XS / SCALE_A / LDW 0 or 1"), (dict(NB=100), "8 \\* NB <= 64"),
                     (dict(waves=0), "waves > 0"), (dict(XR=2, CPA=3), "XR / CLU 0 or 1"),
                     (dict(CLU=4, split_k=4), "XR / CLU 0 or 1"),  # CLU asks; the split count sizes it
                     # the x ring rides the cp.async stages and replaces XS; WG's warpgroup tiles
                     (dict(XR=1), "XR .* needs CPA >= 2"), (dict(XR=1, CPA=3, XS=1), "XR .* needs CPA >= 2"),
                     (dict(WG=1, CPA=3), "WG .* needs XR"), (dict(WG=1, XR=1, CPA=3, TW=2), "WG .* needs XR"),
                     (dict(WG=1, XR=1, CPA=2, TW=1), "CPA >= 3"),
                     (dict(WG=1, XR=1, CPA=3, TW=1, WARPS=6), "WARPS a multiple of 4"),
                     (dict(WG=3, XR=1, CPA=3, TW=1, WARPS=4, SCALE_A=True), "WG 0, 1 or 2"),
                     (dict(WG=2, XR=1, CPA=3, TW=1, WARPS=32, SCALE_A=True), "WARPS <= 28"),
                     # WST is a way to run WG 2's consumers: elsewhere it would be silently ignored
                     (dict(WG=1, XR=1, CPA=4, TW=1, WARPS=4, SCALE_A=True, WST=1), "WST .* needs WG 2"),
                     (dict(WG=2, XR=1, CPA=3, TW=1, WARPS=4, SCALE_A=True, WST=1), "WST .* an even CPA"),
                     (dict(WG=2, XR=1, CPA=4, TW=1, WARPS=4, SCALE_A=True, WST=2), "CUR / WST 0 or 1")):
        with pytest.raises(ValueError, match=msg):
            w4_mma.mma_gemm(x, words, ps, pz, group_size=64, n=64, config=bad)
    with pytest.raises(ValueError, match="unknown config keys"):  # also where the dequantize path runs (M > 64)
        w4_mma.mma_gemm(torch.randn(65, 128, generator=gen).bfloat16(), words, ps, pz, group_size=64, n=64,
                        config=dict(cpa=3))
    with pytest.raises(ValueError, match="must be a dict"):
        w4_mma.mma_gemm(x, words, ps, pz, group_size=64, n=64, config=[("NB", 2)])


def test_shipped_configs_pass_the_config_check():
    """mma_gemm checks only configs a caller passes; the defaults and every entry of the shipped
    choices table run unchecked, so they must pass here (at every M their bucket serves)."""
    import json
    from pathlib import Path
    for m in range(1, w4_mma.MAX_FUSED_M + 1):
        w4_mma.check_config(dict(w4_mma.CONFIGS[w4_mma.bucket(m)]), m)
    table = json.loads((Path(w4_mma.__file__).with_name("gemm_choices.json")).read_text())
    entries = [(key, cfg) for gpu in table.values() for kind in ("w4_mma", w4_mma.PRENORM_KIND)
               for key, cfg in gpu.get(kind, {}).items()]
    assert entries
    # the RMSNorm-prologue rows: M buckets of the kernel's one token block (M <= MAX_NORM_M = 8)
    assert all(int(key.split("|")[0]) in (1, 2, 4, 8) for gpu in table.values()
               for key in gpu.get(w4_mma.PRENORM_KIND, {}))
    for key, cfg in entries:
        m = int(key.split("|")[0])
        m = 8 if m == 1 else m  # an M = 1 entry also serves M = 2..8 (mma_gemm)
        full = {**w4_mma.CONFIGS[w4_mma.bucket(m)], **{k: v for k, v in cfg.items() if k != "schema"}}
        w4_mma.check_config(full, m)


def test_m1_entry_serves_up_to_8_tokens(gen, monkeypatch):
    # the table has M = 1 and M = 16 rows; M = 2..8 (key buckets 2, 4, 8) run the M = 1 row's
    # one-token-block kernel, M = 9..16 their own row, never the defaults when a row is there
    import w4_mma_emulate
    fake = w4_mma_emulate.install(monkeypatch)
    rows = {1: dict(NB=1, TW=2, WARPS=4, KW=2, S=2, schema=w4_mma.TABLE_SCHEMA),
            16: dict(NB=2, TW=1, WARPS=2, KW=1, S=1, schema=w4_mma.TABLE_SCHEMA)}
    monkeypatch.setattr(w4_mma, "lookup", lambda kind, m, n, k, device: rows.get(m if m < 2 else 16 if m > 8 else None))
    q, s, z, w_ref = _quant(256, 128, 64, gen)
    ps, pz = pack_mma_groups(s, z)
    for m, want in ((1, rows[1]), (5, rows[1]), (8, rows[1]), (12, rows[16])):
        x = torch.randn(m, 256, generator=gen).half()
        y = w4_mma.mma_gemm(x, pack_mma(q), ps, pz, group_size=64, n=128)
        assert {k: fake.calls[-1]["cfg"][k] for k in ("NB", "TW", "WARPS", "KW")} == \
            {k: want[k] for k in ("NB", "TW", "WARPS", "KW")}, m
        assert ((y.double() - x.double() @ w_ref.double()).abs().max()).item() <= \
            BOUND[torch.float16] * (x.double() @ w_ref.double()).abs().max().item()


def test_prenorm_rows_serve_the_rmsnorm_kernel_only(gen, monkeypatch):
    # a shape with w4_mma_prenorm rows: mma_gemm_rmsnorm (M 1..8) runs its M bucket's row, else the
    # M = 1 row; the plain GEMM its own w4_mma row; without prenorm rows the RMSNorm kernel takes
    # the w4_mma row
    import w4_mma_emulate
    from kvforge_plugins.quant.kernels.choices import m_bucket
    fake = w4_mma_emulate.install(monkeypatch)
    rows = {("w4_mma", 1): dict(NB=1, TW=2, WARPS=4, KW=2, S=2, schema=w4_mma.TABLE_SCHEMA),
            (w4_mma.PRENORM_KIND, 1): dict(NB=1, TW=1, WARPS=8, KW=4, S=1, schema=w4_mma.TABLE_SCHEMA),
            (w4_mma.PRENORM_KIND, 8): dict(NB=1, TW=1, WARPS=4, KW=2, S=3, schema=w4_mma.TABLE_SCHEMA)}
    have = dict(rows)
    monkeypatch.setattr(w4_mma, "lookup", lambda kind, m, n, k, device: have.get((kind, m_bucket(m))))
    q, s, z, w_ref = _quant(256, 128, 64, gen)
    words, (ps, pz) = pack_mma(q), pack_mma_groups(s, z)
    shape = ("NB", "TW", "WARPS", "KW", "S")
    for m, bucket in ((1, 1), (3, 1), (6, 8), (8, 8)):
        x, res = torch.randn(m, 256, generator=gen).half(), torch.randn(m, 256, generator=gen).half()
        norm_w = (1 + 0.3 * torch.randn(256, generator=gen)).half()
        w4_mma.mma_gemm_rmsnorm(x, res, norm_w, 1e-5, words, ps, pz, group_size=64, n=128)
        want = rows[(w4_mma.PRENORM_KIND, bucket)]
        assert {k: fake.calls[-1]["cfg"][k] for k in shape} == {k: want[k] for k in shape}, m
        w4_mma.mma_gemm(x, words, ps, pz, group_size=64, n=128)
        assert {k: fake.calls[-1]["cfg"][k] for k in shape} == {k: rows[("w4_mma", 1)][k] for k in shape}, m
    del have[(w4_mma.PRENORM_KIND, 1)], have[(w4_mma.PRENORM_KIND, 8)]
    x, res = torch.randn(1, 256, generator=gen).half(), torch.randn(1, 256, generator=gen).half()
    w4_mma.mma_gemm_rmsnorm(x, res, torch.ones(256).half(), 1e-5, words, ps, pz, group_size=64, n=128)
    assert {k: fake.calls[-1]["cfg"][k] for k in shape} == {k: rows[("w4_mma", 1)][k] for k in shape}


def test_gemm_refuses_stages_past_shared_memory(gen, monkeypatch):
    """CPA stages that do not fit the device's shared memory are refused before launch; an
    x slice (XS) that does not fit beside them is dropped instead (each warp then loads x)."""
    import w4_mma_emulate
    fake = w4_mma_emulate.install(monkeypatch, smem_limit=40 * 1024)
    q, s, z, w_ref = _quant(2048, 64, 64, gen)
    ps, pz = pack_mma_groups(s, z)
    x = torch.randn(16, 2048, generator=gen).bfloat16()
    big = dict(NB=2, TW=4, WARPS=4, CPA=4)  # 4 stages x 10 units x 128 threads x 16 B = 80 KB
    assert w4_mma.stage_bytes({**w4_mma.CONFIGS[16], **big}) == 4 * 10 * 128 * 16
    with pytest.raises(ValueError, match="needs 81920 bytes of shared memory for its CPA stages"):
        w4_mma.mma_gemm(x, pack_mma(q), ps, pz, group_size=64, n=64, config=big)
    assert not fake.calls
    # stages 12 KB + the x slice 16 x (2048 + 8) x 2 B = 64 KB: over; without XS the stages take 28 KB
    fits = dict(NB=2, TW=1, WARPS=4, CPA=2, XS=1, split_k=1)
    y = w4_mma.mma_gemm(x, pack_mma(q), ps, pz, group_size=64, n=64, config=fits)
    assert fake.calls[-1]["cfg"]["XS"] == 0 and fake.calls[-1]["smem"] == 2 * 7 * 128 * 16
    ref = x.double() @ w_ref.double()
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() <= BOUND[torch.bfloat16]


def test_table_entries_lists_a_gpus_entries():
    import json
    from kvforge_plugins.quant.kernels.choices import TABLE_PATH, table_entries
    shipped = json.loads(TABLE_PATH.read_text())["NVIDIA H200"]["w4_mma"]
    got = table_entries("w4_mma", "NVIDIA H200")
    assert got == shipped and any(e.get("CLU") for e in got.values())
    assert table_entries("w4_mma", "no such GPU") == {}


def test_untuned_shape_runs_its_nearest_neighbours_config(gen, monkeypatch, tmp_path):
    """A shape the table lacks runs the config of the nearest tuned shape with the same M key
    (log distance in N and K, each within 4x), at M <= 8 the M = 1 rows competing (the nearer
    wins); a shape with no neighbour in reach keeps the M-bucket defaults."""
    import json

    import w4_mma_emulate
    from kvforge_plugins.quant.kernels import choices
    s = w4_mma.TABLE_SCHEMA
    rows = {"1|512|256": dict(NB=1, TW=2, WARPS=4, KW=2, S=2, schema=s),
            "1|2048|256": dict(NB=1, TW=1, WARPS=8, KW=4, S=1, schema=s),
            "16|128|512": dict(NB=2, TW=1, WARPS=2, KW=1, S=1, schema=s),
            "8|1024|256": dict(NB=1, TW=1, WARPS=2, KW=2, S=3, schema=s)}
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"cpu": {"w4_mma": rows}}))
    monkeypatch.setenv("KVFORGE_QUANT_CHOICES", str(path))
    cpu = torch.device("cpu")
    assert choices.nearest("w4_mma", 1, 1024, 256, cpu)[1] == "1|512|256"  # a tie (2x either way): the smaller
    assert choices.nearest("w4_mma", 1, 1536, 256, cpu)[1] == "1|2048|256"
    assert choices.nearest("w4_mma", 1, 512, 2048, cpu) is None  # K 8x away: out of reach
    assert choices.nearest("w4_mma", 16, 256, 256, cpu)[1] == "16|128|512"
    fake = w4_mma_emulate.install(monkeypatch)
    ops = {}
    for n in (1536, 1280):
        q, sc, z, w_ref = _quant(256, n, 64, gen)
        ops[n] = (pack_mma(q), *pack_mma_groups(sc, z), w_ref)
    # N 1536 at M 6: "1|2048|256" (log 4/3) is nearer than "8|1024|256" (log 3/2); at N 1280 the M = 8
    # row (log 5/4) is nearer than "1|2048|256" (log 8/5)
    for n, m, want in ((1536, 1, rows["1|2048|256"]), (1536, 6, rows["1|2048|256"]), (1536, 12, None),
                       (1280, 6, rows["8|1024|256"]), (1280, 1, rows["1|2048|256"])):
        words, ps, pz, wr = ops[n]
        x = torch.randn(m, 256, generator=gen).half()
        y = w4_mma.mma_gemm(x, words, ps, pz, group_size=64, n=n)
        want = {**w4_mma.CONFIGS[w4_mma.bucket(m)], **(want or {})}  # "16|128|512" is 12x away in N
        assert {k: fake.calls[-1]["cfg"].get(k, 1) for k in ("NB", "TW", "WARPS", "KW", "S")} == \
            {k: want.get(k, 1) for k in ("NB", "TW", "WARPS", "KW", "S")}, (n, m)
        ref = x.double() @ wr.double()
        assert ((y.double() - ref).abs().max()).item() <= BOUND[torch.float16] * ref.abs().max().item()
