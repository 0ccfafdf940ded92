"""benchmarks/merge_results.py: a partial run replaces its rows in place and says which run
measured each row (the committed results feed BENCHMARKS.md and the README's tables)."""

import pytest

from benchmarks.merge_results import merge


def test_partial_run_replaces_rows_in_place_and_stamps_them():
    old = {"env": {"date": "old"}, "meta": {"runs": "first run"}, "rows": [
        {"part": "loss", "impl": "chunked", "ms": 28.8},
        {"part": "e2e", "shape": "a", "seq_len": 1, "tok_per_s": 10},
        {"part": "e2e", "shape": "a", "seq_len": 2, "tok_per_s": 20},
    ]}
    new = {"env": {"date": "T2"}, "meta": {}, "rows": [
        {"part": "e2e", "shape": "a", "seq_len": 2, "tok_per_s": 25},
        {"part": "e2e", "shape": "b", "seq_len": 1, "tok_per_s": 5},
    ]}
    merged = merge(old, new, ["part", "shape", "seq_len"], "partial")
    assert merged["rows"] == [
        {"part": "loss", "impl": "chunked", "ms": 28.8},  # no row of the new run matches it
        {"part": "e2e", "shape": "a", "seq_len": 1, "tok_per_s": 10},
        {"part": "e2e", "shape": "a", "seq_len": 2, "tok_per_s": 25, "run": "T2"},
        {"part": "e2e", "shape": "b", "seq_len": 1, "tok_per_s": 5, "run": "T2"},
    ]
    assert merged["meta"]["runs"] == "first run; T2: partial (2 rows)"
    assert merged["env"] == {"date": "T2"}
    assert old["rows"][2]["tok_per_s"] == 20  # the inputs are not modified


def test_e2e_generate_interleaves_providers_and_records_errors(monkeypatch):
    """benchmarks/e2e_generate.py's eager rows on a tiny Llama on the CPU: every provider gets
    a row from alternating runs; a provider that fails gets an error row and the others go on."""
    import sys
    from pathlib import Path

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks import e2e_generate

    import hf_flash

    hf_flash.register()
    monkeypatch.setattr(e2e_generate, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    config = LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                         pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    order = []
    real = e2e_generate._generate

    def spy(model, ids, n, *a):
        order.append((model.config._attn_implementation, n))
        return real(model, ids, n, *a)

    monkeypatch.setattr(e2e_generate, "_generate", spy)
    # 16 new tokens: the per-step estimate (all tokens minus one, over 15 steps) stays well
    # above the timing noise of a loaded 2-core runner
    rows, tokens = e2e_generate.run_interleaved(model, 1, 8, ["hf_flash", "sdpa"], "dynamic", 16, 2)
    assert [r["attn"] for r in rows] == ["hf_flash", "sdpa"]
    assert all("error" not in r and r["ms_per_step"] > 0 for r in rows), rows
    assert set(tokens) == {"hf_flash", "sdpa"} and tokens["sdpa"].shape == (1, 16)
    timed = [a for a, n in order if n == 16]  # warm-ups generate 4 tokens, the switch runs 1
    assert timed == ["hf_flash", "sdpa", "hf_flash", "sdpa"]

    rows, tokens = e2e_generate.run_interleaved(model, 1, 8, ["no_such_attn", "sdpa"], "dynamic",
                                                16, 1)  # fmt: skip
    assert "error" in rows[0] and rows[1]["ms_per_step"] > 0 and set(tokens) == {"sdpa"}
    # a per-step estimate the noise swallowed is an error row, not a negative rate
    row = e2e_generate._row(1, 8, "sdpa", "dynamic", 16, 0.010, 0.009, False)
    assert "per-step time not measurable" in row["error"] and "ms_per_step" not in row


def test_wgmma_wait_order_counts_exponentials_around_the_dp_wait():
    """benchmarks/diagnostics/wgmma_wait_order.py reads, per S^T/dP^T product pair in the SASS,
    how many exponentials sit under the dP^T product (before the wait for all) and after it, and
    how many shared loads were issued between the pair's first k-step and its S^T wait; the
    dV/dK products (A from registers) and dQ products (A transposed) do not start a pair."""
    from benchmarks.diagnostics.wgmma_wait_order import exp_placement

    lds = "LDS.64 R220, [R9+0x38000] ;"
    # a pair whose shared load comes after the S^T wait (not counted), then one with three
    # shared loads among the products' k-steps and between the last one and the wait
    pair = [
        "HGMMA.64x64x16.F32.BF16 R184, gdesc[UR48], RZ, !UPT ;",
        "HGMMA.64x64x16.F32.BF16 R184, gdesc[UR48], R184, gsb0 ;",
        "HGMMA.64x64x16.F32.BF16 R152, gdesc[UR52], RZ, !UPT ;",
        "HGMMA.64x64x16.F32.BF16 R152, gdesc[UR52], R152, gsb0 ;",
        "WARPGROUP.DEPBAR.LE gsb0, 0x1 ;",
        lds,
    ]
    early = [
        "HGMMA.64x64x16.F32.BF16 R184, gdesc[UR48], RZ, !UPT ;",
        "HGMMA.64x64x16.F32.BF16 R184, gdesc[UR48], R184, gsb0 ;",
        "HGMMA.64x64x16.F32.BF16 R152, gdesc[UR52], RZ, !UPT ;",
        lds, lds,
        "HGMMA.64x64x16.F32.BF16 R152, gdesc[UR52], R152, gsb0 ;",
        lds,
        "WARPGROUP.DEPBAR.LE gsb0, 0x1 ;",
    ]
    tail = [
        "HGMMA.64x128x16.F32.BF16 R88, R184, gdesc[UR4].tnspB, R88, gsb0 ;",
        "WARPGROUP.DEPBAR.LE gsb0, 0x1 ;",
        "WARPGROUP.DEPBAR.LE gsb0, 0x0 ;",
        "HGMMA.64x64x16.F32.BF16 R152, gdesc[UR16].tnspA.tnspB, R152, gsb0 ;",
        "WARPGROUP.DEPBAR.LE gsb0, 0x0 ;",
    ]
    ex2 = "MUFU.EX2 R1, R1 ;"
    text = "\n".join(pair + [ex2] * 3 + ["WARPGROUP.DEPBAR.LE gsb0, 0x0 ;"] + [ex2] * 29 + tail
                     + early + ["WARPGROUP.DEPBAR.LE gsb0, 0x0 ;"] + [ex2] * 32 + tail)  # fmt: skip
    assert exp_placement(text) == [{"lds_under_st": 0, "under_dp": 3, "after": 29},
                                   {"lds_under_st": 3, "under_dp": 0, "after": 32}]
    assert exp_placement("\n".join(tail + [ex2])) == []


def test_sass_step_mix_takes_forward_and_backward_variants():
    """sass_step_mix.py resolves forward names and backward names behind ``bwd:`` (not the
    split-D forms, whose tiles are [queries, keys]); the exponentials per step it looks for are
    the scores a consumer thread holds."""
    from benchmarks.diagnostics.sass_step_mix import _variant, exponentials_per_step
    from hf_flash.kernels.hopper import attention_bwd, attention_fwd

    fwd = _variant("ws3x4-pp-s3")
    assert fwd is attention_fwd.VARIANTS["ws3x4-pp-s3"] and exponentials_per_step(fwd) == 64
    bwd = _variant("bwd:kv2x64-m64-s2-dqwldfpsbrr")
    assert bwd is attention_bwd.VARIANTS["kv2x64-m64-s2-dqwldfpsbrr"] and exponentials_per_step(bwd) == 32
    assert exponentials_per_step(attention_bwd.VARIANTS["kv2x64-m128-s2-dqwlds"]) == 64  # d64: 128 rows
    split_d = next(n for n, v in attention_bwd.VARIANTS.items() if v.split_d)
    assert _variant("bwd:" + split_d) is None
    assert _variant("kv2x64-m64-s2-dqwldfpsbrr") is None and _variant("bwd:nope") is None


def test_sass_step_mix_counts_the_step_without_the_masking_arm():
    """benchmarks/diagnostics/sass_step_mix.py takes a loop's shortest head-to-back-edge path
    (the masking arm, a branch of its own, is skipped; out-of-range retry branches count as not
    taken) and ignores outer loops whose shortest path holds fewer exponentials."""
    from benchmarks.diagnostics.sass_step_mix import parse, step_paths

    lines, addr = [], 0

    def emit(ins, label=None):
        nonlocal addr
        if label:
            lines.append(f"{label}:")
        lines.append(f"        /*{addr:04x}*/                   {ins} ;")
        addr += 16

    emit("MOV R1, R2", ".L_x_0")  # the outer loop's head (items of a persistent program)
    emit("@P4 BRA `(.L_x_3)")  # an item without key tiles skips the step
    emit("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT", ".L_x_1")  # the step's head
    emit("@!P1 BRA `(.L_x_9)")  # a barrier wait's out-of-line retry
    emit("@P0 BRA `(.L_x_2)")  # a tile that needs no mask skips the masking arm
    for _ in range(64):
        emit("FSEL R24, R24, -INF , !P6")
    emit("FMNMX R3, R24, R25, !PT", ".L_x_2")
    for _ in range(4):
        emit("MUFU.EX2 R4, R4")
    emit("PRMT R120, R120, 0x5432, R120")
    emit("@P2 BRA `(.L_x_1)")  # the step's back edge
    emit("FMUL R5, R5, R6", ".L_x_3")
    emit("FMUL R5, R5, R6")
    emit("@P3 BRA `(.L_x_0)")  # the outer loop's back edge
    emit("EXIT")
    emit("BRA `(.L_x_1)", ".L_x_9")
    (rec,) = step_paths(parse("\n".join(lines)), min_exp=4)
    assert rec["head"] == "0x20" and rec["body"] == 74
    assert rec["step"] == 10 and rec["essential"] == 5  # head, 2 branches, FMNMX, 4 EX2, PRMT, back edge
    assert rec["mix"] == {"FMNMX": 1, "MUFU.EX2": 4, "PRMT": 1, "HGMMA": 1}
    assert step_paths(parse("\n".join(lines)), min_exp=5) == []


def test_causal_items_model_counts_by_hand():
    """benchmarks/diagnostics/causal_items_model.py on 256 causal queries, 192-row items of three
    64-row consumers, 128-key tiles. From row 0: items at rows 0 and 192, two key tiles each on
    every consumer (12). Ending at the last block: items at rows -128 and 64, one and two tiles
    (3 + 6 = 9); per consumer, the second item's first consumer (rows 64-127) needs one (8; from
    row 0, the first item's first two consumers one each: 10). Each block's own: 1, 1, 2, 2 (6)."""
    from benchmarks.diagnostics.causal_items_model import consumer_tiles, needed_tiles

    counts = {(a, r): consumer_tiles(256, 192, 64, 128, a, r) for a in ("start", "end") for r in ("item", "own")}
    assert counts == {("start", "item"): 12, ("start", "own"): 10, ("end", "item"): 9, ("end", "own"): 8}
    assert needed_tiles(256, 64, 128) == 6
    # items that divide the length: the alignments agree, and 128-row items (d128) need nothing more
    assert consumer_tiles(4096, 128, 64, 128, "start", "item") == consumer_tiles(4096, 128, 64, 128, "end", "item")
    assert consumer_tiles(4096, 128, 64, 128, "end", "item") == needed_tiles(4096, 64, 128)
    with pytest.raises(ValueError, match="multiple of block_m"):
        consumer_tiles(256, 100, 64, 128, "end", "own")


def test_dq_turns_model_counts_the_waits_of_the_ordered_additions():
    """benchmarks/diagnostics/dq_turns_model.py on a case counted by hand: 512 causal queries, 4
    key blocks of 128 (8, 6, 4 and 2 query tiles per head), 2 heads, 4 SMs (all concurrent).
    Ascending turns, tiles upwards head by head: block k re-waits at each head boundary and ends
    at step 15 + k, so 19 steps for 40 steps of work; tiles downwards with the heads inside, block
    k trails block k - 1 by one step and block 0 (16 steps) ends last; without turns the longest
    program sets the time; one round of descending turns never waits."""
    from benchmarks.diagnostics.dq_turns_model import simulate

    shape = dict(sms=4, kv_heads=1, group=2)
    assert simulate(512, 1, "ascending", **shape) == (19, 10.0)
    assert simulate(512, 1, "tiles_down", **shape) == (16, 10.0)
    assert simulate(512, 1, "none", **shape) == (16, 10.0)
    assert simulate(512, 1, "rounds_desc", **shape) == (16, 10.0)
    # two SMs: the programs run in two waves
    span, ideal = simulate(512, 1, "ascending", sms=2, kv_heads=1, group=2)
    assert ideal == 20.0 and span > simulate(512, 1, "none", sms=2, kv_heads=1, group=2)[0]


def test_dq_turns_model_at_128_rows_per_step():
    """The d64 forms' steps (128 query rows): 512 causal queries, 4 key blocks of 128 (4, 3, 2 and
    1 query tiles per head, 2 heads: 20 steps), 4 SMs. Ascending turns, tiles upwards head by
    head: block k waits for block k - 1 at each tile and again at the head boundary, and block 3
    ends at step 11; tiles downwards, block k trails block k - 1 by one step and block 0 (8
    steps) ends last, as without turns."""
    from benchmarks.diagnostics.dq_turns_model import simulate

    shape = dict(sms=4, kv_heads=1, group=2, block_m=128)
    assert simulate(512, 1, "ascending", **shape) == (11, 5.0)
    assert simulate(512, 1, "tiles_down", **shape) == (8, 5.0)
    assert simulate(512, 1, "none", **shape) == (8, 5.0)
    assert simulate(512, 1, "rounds_desc", **shape) == (8, 5.0)


def test_dq_turns_model_with_a_left_window():
    """A 128-key left window at 128 rows per step: 512 causal queries, block k sees tiles k and
    k + 1 (block 3 only tile 3), 2 heads, 132 SMs (14 steps of work). A tile's turns start at the
    lowest block that sees it: block 1 waits for block 0 on tile 1, block 2 for block 1 on tile
    2, block 3 for block 2 on tile 3; counted by hand, ascending turns head by head end at step
    9. A window as long as the sequence is no window."""
    from benchmarks.diagnostics.dq_turns_model import simulate

    assert simulate(512, 1, "ascending", sms=132, kv_heads=1, group=2, block_m=128, window=128) == (9, 14 / 132)
    assert simulate(512, 1, "ascending", sms=132, kv_heads=1, group=2, block_m=128, window=0) == (2, 8 / 132)
    for order in ("ascending", "tiles_down", "none"):
        shape = dict(kv_heads=2, group=2, sms=16)
        assert simulate(2048, 2, order, window=2048, **shape) == simulate(2048, 2, order, **shape)
    with pytest.raises(ValueError, match="causal"):
        simulate(512, 1, "ascending", causal=False, window=128)


def test_dq_turns_model_without_masking():
    """The same case without masking: each of the 4 blocks walks all 8 tiles of both heads (16
    steps). Block k waits k steps for its first turn and then trails block k - 1 by one step,
    so the last ends at step 19 for 16 steps of work per SM; without turns every block ends at 16.
    The persistent round order is modelled for causal programs only and says so."""
    from benchmarks.diagnostics.dq_turns_model import simulate

    shape = dict(sms=4, kv_heads=1, group=2, causal=False)
    assert simulate(512, 1, "ascending", **shape) == (19, 16.0)
    assert simulate(512, 1, "none", **shape) == (16, 16.0)
    with pytest.raises(ValueError, match="causal programs only"):
        simulate(512, 1, "rounds_desc", **shape)


def test_attention_grid_rounds_alternate_providers_and_keep_the_median(monkeypatch):
    """benchmarks/attention.py --rounds on the dense grid: providers take turns round by round and
    each row holds a provider's median round with every round's time. The timing itself is
    replaced (no GPU): what is checked is the bookkeeping."""
    import argparse

    import torch

    from benchmarks import attention

    monkeypatch.setattr(attention, "DEVICE", "cpu")
    monkeypatch.setattr(attention, "_free", lambda: None)
    calls = []
    scripted = {"hf_flash": iter([3.0, 1.0, 2.0]), "sdpa": iter([4.0, 6.0, 3.0])}

    def fake_time_passes(attn, leaves, dout, passes, timing):
        name = attn.__name__
        calls.append(name)
        ms = next(scripted[name])
        return {"fwd": {"ms": ms, "p20_ms": ms - 0.5, "p80_ms": ms + 0.5}}

    monkeypatch.setattr(attention, "time_passes", fake_time_passes)

    def provider(name, layout):
        def build(shape, q, k, v, dout):
            def attn():
                return torch.zeros(layout(q.shape))

            attn.__name__ = name
            return attn, (), None, {"built": name}

        return build

    build = {"hf_flash": provider("hf_flash", lambda s: s),
             "sdpa": provider("sdpa", lambda s: (s[0], s[2], s[1], s[3]))}  # fmt: skip
    args = argparse.Namespace(providers=["hf_flash", "sdpa"], passes=["fwd"], rounds=3)
    (row,) = attention.run_shape(64, "causal", 16384, args, build, {})
    # odd rounds run the providers in reverse order
    assert calls == ["hf_flash", "sdpa", "sdpa", "hf_flash", "hf_flash", "sdpa"]
    hf, sd = row["results"]["hf_flash"], row["results"]["sdpa"]
    assert (hf["ms"], hf["p20_ms"], hf["rounds_ms"]) == (2.0, 1.5, [3.0, 1.0, 2.0])
    assert (sd["ms"], sd["rounds_ms"]) == (4.0, [4.0, 6.0, 3.0])
    assert row["ratio"]["sdpa"] == 4.0 / 2.0  # TFLOP/s ratio = inverse time ratio
    # per round 4/3, 6/1, 3/2: the median of the paired ratios, not the ratio of the medians
    assert row["ratio_paired"]["sdpa"] == 1.5
    assert row["ratio_paired"]["flex"] is None  # not run
    assert row["max_abs_diff_vs_sdpa"] == 0.0, row["spot_check_error"]


def test_attention_grid_takes_lengths_and_head_dims_outside_the_default_grid():
    import argparse

    from benchmarks import attention

    def grid(**kw):
        base = dict(quick=False, head_dims=None, masks=None, seqlens=None)
        return attention.grid(argparse.Namespace(**{**base, **kw}))

    assert 512 not in attention.SEQLENS
    assert grid(head_dims=[128], masks=["causal", "full"], seqlens=[512, 1024]) == [
        (128, "causal", 512), (128, "causal", 1024), (128, "full", 512), (128, "full", 1024)]
    assert 512 not in attention.HEAD_DIMS
    assert grid(head_dims=[512], masks=["causal"], seqlens=[4096]) == [(512, "causal", 4096)]
    # the window mask needs sequences longer than its window
    assert grid(head_dims=[64], masks=["window"], seqlens=[512]) == []
    assert {s for _, _, s in grid()} == set(attention.SEQLENS)


def test_paired_ratio_needs_two_paired_rounds():
    from benchmarks.attention import paired_ratio

    assert paired_ratio({"rounds_ms": [2.0, 4.0]}, {"rounds_ms": [3.0, 4.0]}) == (1.5 + 1.0) / 2
    assert paired_ratio({"rounds_ms": [2.0]}, {"rounds_ms": [3.0]}) is None  # one round
    assert paired_ratio({"rounds_ms": [2.0, 4.0]}, {"rounds_ms": [3.0]}) is None  # a round errored
    assert paired_ratio({"error": "x"}, {"rounds_ms": [3.0, 4.0]}) is None


def test_median_round_reports_the_error_when_no_round_was_timed():
    from benchmarks.attention import median_round

    assert median_round([{"error": "a"}, {"error": "b"}]) == {"error": "b"}
    assert median_round([{"error": "a"}, {"ms": 2.0}])["rounds_ms"] == [2.0]


def _bar_row(mask, seqlen, pass_, results, ratio, run="r1", head_dim=128):
    return {"head_dim": head_dim, "mask": mask, "seqlen": seqlen, "pass": pass_, "batch": 1,
            "run": run, "results": results, "ratio": ratio}  # fmt: skip


def test_bars_check_only_what_the_run_measured():
    """benchmarks/bars.py: issue 15's checks where SDPA ran (a failing ratio fails), issue 2's
    only against the peers that ran (an errored peer fails), the window check only beside a
    causal row of the same run."""
    from benchmarks.bars import bar_checks, window_speedup

    ok = {"ms": 1.0}
    rows = [
        _bar_row("causal", 4096, "fwd", {"hf_flash": ok, "sdpa": ok}, {"sdpa": 1.04}),
        _bar_row("full", 4096, "fwd+bwd", {"hf_flash": ok, "sdpa": ok}, {"sdpa": 0.97}),
        _bar_row("causal", 8192, "fwd", {"hf_flash": ok, "sdpa_flash": {"error": "boom"}},
                 {"sdpa_flash": None}),  # fmt: skip
        _bar_row("causal", 32768, "fwd", {"hf_flash": {"ms": 6.0}}, {}),
        _bar_row("window", 32768, "fwd", {"hf_flash": {"ms": 1.5}}, {}),
        _bar_row("window", 32768, "fwd+bwd", {"hf_flash": {"ms": 1.0}}, {}, run="r2"),
    ]
    got = {c["check"]: (c["bar"], c["ok"], c["got"]) for c in bar_checks(rows)}
    assert got == {
        "D128 causal S=4096 fwd vs sdpa": ("issue 15", True, 1.04),
        "D128 full S=4096 fwd+bwd vs sdpa": ("issue 15", False, 0.97),
        "D128 causal S=8192 fwd vs sdpa_flash": ("issue 2", False, None),
        "D128 window S=32768 fwd vs own causal": ("issue 2", True, 4.0),
    }
    assert window_speedup(rows[-1], rows) is None  # its causal twin is from another run


def test_backward_benchmark_runs_a_named_variant_at_every_length():
    # the picked variant must not be overridden by a query-length range of the dispatch (a
    # 2K-4K non-causal row once ran the -kf form under any name), and the dispatch comes back
    import torch

    from benchmarks.hopper_attention_bwd import providers
    from hf_flash.kernels.hopper import attention_bwd as hb

    (_, hi, ranged), *_ = hb.SEQLEN_VARIANTS[(128, False)]
    assert hb.variant_for(128, False, False, hi) == ranged  # what the pick has to override
    taken = {hb.DEFAULT[(128, False)], hb.DEFAULT[(128, True)]} | {
        r[2] for rs in hb.SEQLEN_VARIANTS.values() for r in rs
    }
    other = next(n for n, v in hb.VARIANTS.items() if n not in taken and 128 in v.head_dims)
    default, ranges = dict(hb.DEFAULT), {k: tuple(v) for k, v in hb.SEQLEN_VARIANTS.items()}
    q = torch.zeros(1, 4096, 4, 128)
    k = v = torch.zeros(1, 4096, 2, 128)
    fns = providers(q, k, v, q, False, [other], triton_backward=False)
    assert "hf_flash_tbwd" not in fns and {"hopper:" + other, "sdpa"} <= set(fns)
    _, pick = fns["hopper:" + other]
    with pick():
        for s in (1024, 2048, 4096, 8192, 32768):
            assert hb.variant_for(128, False, False, s) == other
            assert hb.variant_for(128, True, False, s) == other
    assert hb.DEFAULT == default and {k: tuple(v) for k, v in hb.SEQLEN_VARIANTS.items()} == ranges
    # a dK/dV-only variant with its dQ kernel named: both pinned inside, both restored after
    from hf_flash.kernels.hopper import attention_dq

    dq_default = dict(attention_dq.DEFAULT)
    fns = providers(q, k, v, q, False, ["kv2x64-m64-s2+triton", "kv2x64-m64-s2+dq2x64-n64-s3"], triton_backward=False)
    with fns["hopper:kv2x64-m64-s2+triton"][1]():
        assert hb.variant_for(128, False, False, 4096) == "kv2x64-m64-s2" and attention_dq.variant_for(128) is None
    with fns["hopper:kv2x64-m64-s2+dq2x64-n64-s3"][1]():
        assert attention_dq.variant_for(128) == attention_dq.variant_for(128, varlen=True) == "dq2x64-n64-s3"
    assert attention_dq.DEFAULT == dq_default and hb.DEFAULT == default


def test_backward_benchmark_times_each_pinned_variant_through_the_call_plans(monkeypatch):
    """benchmarks/hopper_attention_bwd.py's rows call flash_attn_func, whose call plans fix both
    passes' kernels at the forward: each hopper:<variant> row (and hf_flash_tbwd) must launch its
    own backward kernel although every row has the same signature. The CPU is made to look like
    an sm_90 device and every compiled launch is recorded (none runs); the Gluon backward
    kernels tell the variants apart by their constexprs."""
    import torch

    from benchmarks.hopper_attention_bwd import providers, timed_passes
    from hf_flash import interface
    from hf_flash.kernels import configs, launch
    from hf_flash.kernels.hopper import attention_bwd as hb
    from hf_flash.kernels.hopper import attention_fwd as hf
    from hf_flash.kernels.launch import CachedLauncher

    seen = []
    monkeypatch.setattr(CachedLauncher, "__call__",
                        lambda self, grid, tensors, ints, floats, meta: seen.append((self.kernel.fn.__name__,
                                                                                      meta.kwargs)))  # fmt: skip
    monkeypatch.setattr(configs, "hopper_enabled", lambda device: True)
    monkeypatch.setattr(hf, "_on_hopper", lambda t: True)
    monkeypatch.setattr(interface, "_DENSE_PLANS", launch.PlanCache())
    monkeypatch.setattr(configs, "_HOPPER_BWD", True)
    q, k, v, dout = (torch.randn(1, 512, h, 64, dtype=torch.bfloat16) for h in (8, 2, 2, 8))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    names = ["kv2x64-m128-s2-dqwlds", "kv2x64-m128-s2-dqwlds-dn", "kv2x64-m128-s2-dqwlds-kf"]
    fns = providers(q, k, v, dout, True, names)
    del fns["sdpa"]

    def backward_kernels(passes):
        taken = {}
        for name, (fwd, ctx) in fns.items():
            bwd, fb = timed_passes(fwd, ctx, (q, k, v), dout)
            del seen[:]
            (bwd if passes == "bwd" else fb)()
            taken[name] = [(n, m.get("TILES_DOWN"), m.get("KEY_FASTEST")) for n, m in seen
                           if n.startswith("_attn_bwd")] or [n for n, _ in seen]  # fmt: skip
        return taken

    for passes in ("bwd", "fwd+bwd"):
        taken = backward_kernels(passes)
        gluon = [taken["hopper:" + n] for n in names]
        assert len({str(t) for t in gluon}) == 3, (passes, gluon)  # three variants, three kernels
        assert gluon[1][0][1] and not gluon[0][0][1] and gluon[2][0][2] == 1, (passes, gluon)
        assert not any(n.startswith("_attn_bwd") for n in taken["hf_flash_tbwd"]), taken["hf_flash_tbwd"]


def test_bench_ms_min_calls_grows_the_repetition_window(monkeypatch):
    """benchmarks.harness.bench_ms(min_calls=n): one call is timed first and the timing loop's
    window (rep_ms) grows to hold n calls of that length; calls shorter than rep_ms / n keep
    rep_ms. The CUDA events and Triton's timing loop are replaced (no GPU): what is checked is
    the window handed to the loop."""
    import sys
    import types

    import torch
    import triton

    from benchmarks import harness

    class FakeEvent:
        def __init__(self, enable_timing=False):
            pass

        def record(self):
            pass

        def elapsed_time(self, other):
            return call_ms

    seen = []

    def fake_do_bench(fn, warmup, rep, quantiles):
        seen.append(rep)
        return 1.0, 0.5, 1.5

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    fake_testing = types.SimpleNamespace(do_bench=fake_do_bench)
    monkeypatch.setitem(sys.modules, "triton.testing", fake_testing)
    monkeypatch.setattr(triton, "testing", fake_testing, raising=False)
    calls = []
    for call_ms in (120.0, 2.0):
        harness.bench_ms(lambda: calls.append(1), rep_ms=40, min_calls=5)
    assert seen == [pytest.approx(1.1 * 5 * 120.0), 40]
    assert len(calls) == 2  # the one timed call each; the loop itself is the fake's
    assert harness.bench_ms(lambda: None, rep_ms=40) == {"ms": 1.0, "p20_ms": 0.5, "p80_ms": 1.5}
    assert seen[-1] == 40  # min_calls 1: no call timed first
    with pytest.raises(ValueError, match="min_calls"):
        harness.bench_ms(lambda: None, min_calls=0)


def test_backward_benchmark_window_option():
    # a windowed run has no SDPA row (SDPA takes no window) and is causal only
    import torch

    from benchmarks.hopper_attention_bwd import main, providers
    from hf_flash.kernels.hopper import attention_bwd as hb

    with pytest.raises(SystemExit):
        main(["unused.json", "--window", "4096", "--masks", "full"])
    with pytest.raises(SystemExit):
        main(["unused.json", "--window", "-8", "--masks", "causal"])
    q = torch.zeros(1, 256, 4, 128)
    k = v = torch.zeros(1, 256, 2, 128)
    name = hb.DEFAULT[(128, True)]
    assert set(providers(q, k, v, q, True, [name], triton_backward=False, window=(4095, 0))) == {"hopper:" + name}
    assert "sdpa" in providers(q, k, v, q, True, [name], triton_backward=False)


def test_host_ab_prepare_renames_every_reference(tmp_path):
    """benchmarks/diagnostics/host_ab.py --prepare: a revision's hf_flash copied as hf_flash_base,
    with no import of, or torch.library op in, the working tree's package left in it (the two run
    in one process)."""
    import re

    from benchmarks.diagnostics.host_ab import BASE, prepare

    prepare("HEAD", tmp_path)
    files = list((tmp_path / BASE).rglob("*.py"))
    assert any(f.name == "interface.py" for f in files)
    imports = re.compile(r"^(from|import)\s+hf_flash\b(?!_base)")
    for f in files:
        for line in f.read_text().splitlines():
            assert not imports.search(line.strip()) and "hf_flash::" not in line, (f, line)
    assert "hf_flash_base::attn_fwd" in (tmp_path / BASE / "interface.py").read_text()


def test_packed_forms_sets_the_dispatch_tables_and_restores_them():
    """benchmarks/diagnostics/packed_forms.py: inside ``packed_form`` the packed calls of one head
    dim take the named forward and backward (or Triton's), and the tables come back as they were,
    an error inside the block included; unknown variants and forms without a packed build are
    refused before anything changes."""
    from benchmarks.diagnostics.packed_forms import packed_form
    from hf_flash.kernels.hopper import attention_bwd as hb
    from hf_flash.kernels.hopper import attention_fwd as hf

    from hf_flash.kernels.hopper import attention_dq as hdq

    before = (hf.VARLEN_DISPATCH_HEAD_DIMS, dict(hf.VARLEN_DEFAULT), dict(hb.VARLEN_DEFAULT), dict(hdq.VARLEN_DEFAULT))
    with packed_form(64, True, "ws2x4-overlap-fma", "kv2x64-m64-s2-dqa"):
        assert 64 in hf.VARLEN_DISPATCH_HEAD_DIMS
        assert hf.default_variant(64, True, varlen=True) == "ws2x4-overlap-fma"
        assert hb.VARLEN_DEFAULT[(64, True)] == "kv2x64-m64-s2-dqa"
        assert hb.VARLEN_DEFAULT[(64, False)] == before[2][(64, False)]  # the other causality untouched
        assert hdq.VARLEN_DEFAULT == before[3]  # no +DQ: the library's dQ choice
    with packed_form(64, True, "triton", "kv2x64-m64-s2+triton"):
        assert hb.VARLEN_DEFAULT[(64, True)] == "kv2x64-m64-s2" and hdq.variant_for(64, varlen=True) is None
    with packed_form(64, True, "triton", "kv2x64-m64-s2+dq2x64-n64-s3"):
        assert hdq.variant_for(64, varlen=True) == "dq2x64-n64-s3"
    with pytest.raises(RuntimeError):
        with packed_form(128, False, "triton", "triton"):
            assert 128 not in hf.VARLEN_DISPATCH_HEAD_DIMS and (128, False) not in hb.VARLEN_DEFAULT
            assert (128, True) in hb.VARLEN_DEFAULT
            raise RuntimeError("inside the block")
    assert (hf.VARLEN_DISPATCH_HEAD_DIMS, dict(hf.VARLEN_DEFAULT), dict(hb.VARLEN_DEFAULT),
            dict(hdq.VARLEN_DEFAULT)) == before
    for fwd, bwd, what in (("ws9", "triton", "unknown variant"), ("triton", "kv9", "unknown variant"),
                           ("triton", "kv2x64-m64-s2+dq9", "unknown dQ variant"),
                           ("ws3x4-pp-s3", "triton", "no packed form"),
                           ("triton", "kv2x64-m128-s2-dqwlds", "no packed form")):  # fmt: skip
        with pytest.raises(ValueError, match=what):
            with packed_form(64, False, fwd, bwd):
                pass
        assert (hf.VARLEN_DISPATCH_HEAD_DIMS, dict(hf.VARLEN_DEFAULT), dict(hb.VARLEN_DEFAULT),
                dict(hdq.VARLEN_DEFAULT)) == before


def test_packed_inputs_and_flops_shared_by_the_packed_benchmarks(monkeypatch):
    """benchmarks/attention.py's packed rows and diagnostics/packed_forms.py draw their inputs
    from one helper: the same tensors for the same documents and head dim, cu_seqlens their
    cumulative lengths, and FLOPs from each document's own square (halved when causal)."""
    import torch

    from benchmarks import attention as bench

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    lens = [3, 5, 0, 8]
    q, k, v, dout, cu, max_len = bench.packed_inputs(lens, 64)
    assert q.shape == dout.shape == (16, bench.NHEADS_Q, 64) and k.shape == v.shape == (16, bench.NHEADS_KV, 64)
    assert cu.tolist() == [0, 3, 8, 8, 16] and cu.dtype == torch.int32 and max_len == 8
    again = bench.packed_inputs(lens, 64)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v, dout), again[:4]))
    assert not torch.equal(q, bench.packed_inputs(lens, 128)[0][..., :64])
    full = 4.0 * bench.NHEADS_Q * 64 * (9 + 25 + 64)
    assert bench.packed_flops(lens, 64, causal=False) == full and bench.packed_flops(lens, 64) == full / 2
