"""nvcc compiles the family for sm_80 and sm_90 (no GPU needed) and the defaults do not spill."""
import dataclasses
import itertools
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from flashgen.compile import CompileError, compile_kernel, parse_ptxas, target_for
from flashgen.config import HALF_DTYPES, HEAD_DIMS, KernelConfig, default_config

from conftest import compile_sm90a_clean


@pytest.fixture(autouse=True)
def fresh_cache(run_kernel_cache, monkeypatch):
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(run_kernel_cache))


@pytest.mark.sweep
@pytest.mark.parametrize("arch", ["sm80", "sm90"])
def test_defaults_compile_without_spills(arch):
    cfgs = [default_config(hd, dt, c, arch) for hd, dt, c in itertools.product(HEAD_DIMS, HALF_DTYPES, (False, True))]
    with ThreadPoolExecutor(max_workers=2) as pool:
        kernels = list(pool.map(lambda c: compile_kernel(c, target_for(arch, "sm80")), cfgs))
    for k in kernels:
        r = k.resources
        assert k.cubin[:4] == b"\x7fELF", k.name
        assert 0 < r.registers <= 255, k.name
        assert not r.spills and r.stack_bytes == 0, f"{k.name} spills: {r}"
        assert r.smem_bytes == k.config.smem_bytes


@pytest.mark.parametrize("cfg", [
    KernelConfig(32, "fp16", True, 64, 32, 2, 3),      # 64-byte swizzle rows, 2 m-tiles per warp
    KernelConfig(96, "bf16", False, 128, 128, 8, 1),   # head dim not a multiple of 64
    KernelConfig(64, "bf16", True, 256, 32, 16, 4),    # 512 threads, 4 stages
])
def test_representative_configs_compile(cfg):
    for target in ("sm_80", "sm_90"):
        assert compile_kernel(cfg, target).resources.registers > 0


def test_second_compile_hits_the_cache():
    cfg = KernelConfig(64, "fp16", False, 64, 64, 4, 1)
    first = compile_kernel(cfg, "sm_80")
    second = compile_kernel(cfg, "sm_80")
    assert second.cached and second.cubin == first.cubin and second.resources == first.resources
    assert not compile_kernel(cfg, "sm_80", use_cache=False).cached


def test_compile_error_names_config_and_shows_nvcc(monkeypatch):
    import flashgen.compile as comp

    cfg = KernelConfig(64, "fp16", False, 64, 64, 4, 1)
    monkeypatch.setattr(comp, "render", lambda c: "this is not CUDA;")
    with pytest.raises(CompileError, match=f"(?s)nvcc failed for {cfg.name}.*error: expected a declaration"):
        comp.compile_kernel(cfg, "sm_80", use_cache=False)


def test_parse_ptxas_report():
    log = ("ptxas info    : Compiling entry function 'k1' for 'sm_90'\n"
           "ptxas info    : Function properties for k1\n"
           "    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers, 8 bytes cumulative stack size\n")
    r = parse_ptxas(log, "k1", 1024)
    assert (r.registers, r.spill_stores, r.spill_loads, r.stack_bytes, r.smem_bytes) == (255, 4, 12, 8, 1024)
    assert r.spills
    with pytest.raises(CompileError, match="could not read"):
        parse_ptxas("nothing", "k1", 0)


@pytest.mark.sweep
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("overlap,pingpong", [(False, False), (True, False), (False, True), (True, True)])
def test_sm90_family_compiles_for_sm90a_without_spills_or_serialized_wgmma(overlap, pingpong, persistent):
    cfgs = [KernelConfig(hd, dt, causal, 128, bn, 12, 2, "sm90", overlap, pingpong, persistent)
            for hd, bn in ((64, 128), (128, 128), (256, 64)) for dt, causal in (("bf16", True), ("fp16", False))]
    compile_sm90a_clean(cfgs)


@pytest.mark.sweep
@pytest.mark.parametrize("pingpong", [False, True])
def test_sm90_overlap_epilogue_compiles_without_spills_or_serialized_wgmma(pingpong):
    """The epilogue written while the next tile's first QK^T runs (d64/d128; d256 spills with it and is left to
    the tuner): ptxas keeps the wgmmas asynchronous; the renders without the knob are unchanged."""
    from flashgen.render import render

    cfgs = [KernelConfig(hd, dt, causal, 128, 128, 12, 2, "sm90", True, pingpong, True, overlap_epilogue=True)
            for hd in (64, 128) for dt, causal in (("bf16", True), ("fp16", False))]
    compile_sm90a_clean(cfgs)
    plain = KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", True, pingpong, True)
    assert "flush();" in render(cfgs[2]) and "flush();" not in render(plain)  # plain: only comments name it


def test_overlap_epilogue_rules_and_space():
    from flashgen.config import ConfigError, space

    with pytest.raises(ConfigError, match="persistent=True and overlap=True"):
        KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", False, False, True, overlap_epilogue=True)
    with pytest.raises(ConfigError, match="persistent=True and overlap=True"):
        KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", True, False, False, overlap_epilogue=True)
    with pytest.raises(ConfigError, match="16-bit"):
        KernelConfig(128, "fp8_e4m3", True, 128, 128, 12, 2, "sm90", True, False, True, overlap_epilogue=True)
    cfg = KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", True, True, True, overlap_epilogue=True)
    assert cfg.name.endswith("_ov1_pp1_ps_oe") and KernelConfig.from_dict(cfg.to_dict()) == cfg
    sp = space("sm90", 128, "bf16", True)
    oe = [c for c in sp if c.overlap_epilogue]
    assert oe and {dataclasses.replace(c, overlap_epilogue=False) for c in oe} == {
        c for c in sp if c.persistent and c.overlap and not c.overlap_epilogue}
    assert not any(c.overlap_epilogue for c in space("sm90", 128, "fp8_e4m3", False))


@pytest.mark.sweep
def test_sm90_lazy_rescale_compiles_without_spills_or_serialized_wgmma():
    """Lazy rescaling, 16-bit in the overlapped schedule (with and without ping-pong, persistent, overlap_epilogue)
    and FP8 in both schedules (with and without the row sums on the tensor cores), at the defaults' tiles: ptxas
    keeps the wgmmas asynchronous and spill-free; the O rescale sits behind the warp's vote, and renders without
    the knob have neither."""
    from flashgen.render import render

    cfgs = [KernelConfig(hd, dt, causal, 128, 128 if hd < 256 else 64, 12, 2, "sm90", True, pp, ps, overlap_epilogue=oe,
                         lazy_rescale=True)
            for hd in (64, 128, 256) for (dt, causal), (pp, ps, oe) in zip(
                (("bf16", True), ("fp16", False), ("bf16", False)), ((False, False, False), (True, True, False),
                                                                     (False, True, hd < 256)))]
    fp8 = [KernelConfig(hd, "fp8_e4m3", causal, 128, 128 if hd < 256 else 64, 12, 2, "sm90", ov, False, True, mma_rowsum=rs,
                        lazy_rescale=True)
           for hd in (64, 128, 256) for causal, ov, rs in ((False, False, True), (True, True, False))]
    for k in compile_sm90a_clean(cfgs + fp8):
        vote = "__any_sync(0xffffffffu, moved)" if k.config.fp8 else "__all_sync"
        assert vote in k.source and ("if (softmax_into(a, j))" in k.source or "if (moved)" in k.source)
    for c in cfgs + fp8:
        off = render(dataclasses.replace(c, lazy_rescale=False))
        assert "moved" not in off and "__all_sync" not in off and "__any_sync" not in off


def test_lazy_rescale_rules_name_and_space():
    from flashgen.config import ConfigError, space

    with pytest.raises(ConfigError, match="overlap=True"):  # only the overlapped schedule's softmax has it
        KernelConfig(128, "bf16", False, 128, 128, 12, 2, "sm90", False, True, True, lazy_rescale=True)
    with pytest.raises(ConfigError, match="block_quant_p"):
        KernelConfig(128, "fp8_e4m3", False, 128, 128, 12, 2, "sm90", block_quant_p=True, lazy_rescale=True)
    with pytest.raises(ConfigError, match="sm90"):
        KernelConfig(128, "bf16", False, 128, 64, 8, 2, "sm80", lazy_rescale=True)
    cfg = KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", True, True, True, overlap_epilogue=True,
                       lazy_rescale=True)
    assert cfg.name.endswith("_oe_lz") and KernelConfig.from_dict(cfg.to_dict()) == cfg
    old = dataclasses.replace(cfg, lazy_rescale=False)  # a store entry or trial from before the knob reads as off
    d = old.to_dict()
    d.pop("lazy_rescale")
    assert KernelConfig.from_dict(d) == old and cfg.name == old.name + "_lz"
    for dt in ("bf16", "fp8_e4m3"):  # every 16-bit overlapped tile and every FP8 tile comes both ways
        sp = space("sm90", 128, dt, True)
        on = {dataclasses.replace(c, lazy_rescale=False) for c in sp if c.lazy_rescale}
        assert on == {c for c in sp if (c.overlap or c.fp8) and not c.lazy_rescale}
    assert not any(c.lazy_rescale for c in space("sm80", 128, "bf16", True))


def test_a_hung_nvcc_times_out(tmp_path, monkeypatch):
    import time

    import flashgen.compile as comp

    nvcc = tmp_path / "nvcc"  # answers --version, then hangs in a child process as a stuck ptxas would
    nvcc.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo "Cuda compilation tools, release 13.0, V13.0.88"; '
                    'exit 0; }\nsleep 30\n')
    nvcc.chmod(0o755)
    monkeypatch.setenv("FLASHGEN_NVCC", str(nvcc))
    monkeypatch.setenv("FLASHGEN_NVCC_TIMEOUT", "1")
    comp.nvcc_path.cache_clear()
    comp.nvcc_version.cache_clear()
    start = time.monotonic()
    try:
        with pytest.raises(CompileError, match="timed out after 1 s.*FLASHGEN_NVCC_TIMEOUT"):
            compile_kernel(KernelConfig(64, "fp16", False, 64, 64, 4, 1), "sm_80", use_cache=False)
    finally:
        comp.nvcc_path.cache_clear()
        comp.nvcc_version.cache_clear()
    assert time.monotonic() - start < 10


@pytest.mark.sweep
def test_three_consumer_warpgroups_get_32_registers_of_headroom():
    """Three 16-bit consumer warpgroups (160 registers each) may hold 128 accumulator registers: d64's 192 x 128 tile
    with overlap (FlashAttention-3's d64 tile) compiles spill-free there without a mask, so the space has it (with
    causal's small spills too, for the tuner to time); two consumers and FP8 keep 40 registers of headroom."""
    from flashgen.config import space

    fa3 = KernelConfig(64, "bf16", False, 192, 128, 16, 2, "sm90", True, False, persistent=True, lazy_rescale=True)
    assert fa3.accum_regs == 128 == fa3.max_accum_regs and fa3.unfit_reason("sm90") is None
    assert fa3 in space("sm90", 64, "bf16", False) and dataclasses.replace(fa3, causal=True) in space("sm90", 64, "bf16", True)
    compile_sm90a_clean([fa3, dataclasses.replace(fa3, dtype="fp16", persistent=False, lazy_rescale=False)])
    assert KernelConfig(128, "bf16", False, 128, 128, 12, 2, "sm90", True).max_accum_regs == 200
    # FP8's second P in flight is a byte a probability: its 192 x 128 overlapped d64 tile (112) fits and builds clean
    fp8 = KernelConfig(64, "fp8_e4m3", False, 192, 128, 16, 2, "sm90", True, out_dtype="bf16")
    assert fp8.accum_regs == 112 == fp8.max_accum_regs == 152 - 40 and fp8.unfit_reason("sm90") is None
    assert dataclasses.replace(fp8, block_n=192).unfit_reason("sm90") is not None
    compile_sm90a_clean([fp8])


@pytest.mark.sweep
def test_q_regs_rules_name_space_and_clean_compiles():
    """Q in registers (q_regs): 16-bit sm90 only, named _qr, in the space beside every other knob, its A fragments
    counted with the accumulators; ptxas keeps the wgmmas asynchronous and spill-free at the defaults' tiles in
    both schedules, persistent (Q's buffer freed at the tile's start) or not; renders without it are unchanged."""
    from flashgen.config import ConfigError, space
    from flashgen.render import render

    with pytest.raises(ConfigError, match="16-bit"):
        KernelConfig(128, "fp8_e4m3", False, 128, 128, 12, 2, "sm90", q_regs=True)
    with pytest.raises(ConfigError, match="sm90"):
        KernelConfig(128, "bf16", False, 128, 64, 8, 2, "sm80", q_regs=True)
    cfg = KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", True, False, True, lazy_rescale=True, q_regs=True)
    assert cfg.name.endswith("_ov1_pp0_ps_lz_qr") and KernelConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.accum_regs == dataclasses.replace(cfg, q_regs=False).accum_regs + 128 // 4
    sp = space("sm90", 64, "fp16", False)
    assert {dataclasses.replace(c, q_regs=False) for c in sp if c.q_regs} <= set(sp) and any(c.q_regs for c in sp)
    assert not any(c.q_regs for c in space("sm90", 128, "fp8_e4m3", False))
    cfgs = [KernelConfig(hd, dt, causal, 128, 128, 12, 2, "sm90", ov, pp, ps, lazy_rescale=ov, q_regs=True)
            for hd in (64, 128) for (dt, causal), (ov, pp, ps) in zip((("bf16", True), ("fp16", False)),
                                                                      ((True, False, False), (False, True, True)))]
    for k in compile_sm90a_clean(cfgs):
        assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in k.source and "wgmma_qk_rs(" in k.source
        assert ("mbar_arrive(bar_free_q);  // Q is in registers" in k.source) == k.config.persistent
    off = render(dataclasses.replace(cfgs[-1], q_regs=False))
    assert "wgmma_qk_rs" not in off and "load_q" not in off


@pytest.mark.sweep
def test_o_tma_rules_name_space_and_clean_compiles():
    """O through shared memory and bulk copies (o_tma): dense 16-bit sm90 only, named _ot, in the space, its staging
    rows (padded by 16 bytes) in the shared memory figure; ptxas keeps the wgmmas asynchronous and spill-free at the
    defaults' tiles, persistent or not, with overlap_epilogue; renders without it are unchanged."""
    from flashgen.config import ConfigError, space
    from flashgen.render import render

    with pytest.raises(ConfigError, match="dense 16-bit"):
        KernelConfig(128, "fp8_e4m3", False, 128, 128, 12, 2, "sm90", o_tma=True)
    with pytest.raises(ConfigError, match="dense 16-bit"):
        KernelConfig(128, "bf16", False, 128, 64, 8, 2, "sm80", o_tma=True)
    with pytest.raises(ConfigError, match="dense 16-bit"):
        KernelConfig(128, "bf16", False, 128, 64, 12, 2, "sm90", varlen=True, o_tma=True)
    cfg = KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", True, True, True, lazy_rescale=True, o_tma=True)
    plain = dataclasses.replace(cfg, o_tma=False)
    assert cfg.name.endswith("_ov1_pp1_ps_lz_ot") and KernelConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.smem_bytes == plain.smem_bytes + 128 * (128 + 8) * 2
    sp = space("sm90", 64, "fp16", True)
    assert {dataclasses.replace(c, o_tma=False) for c in sp if c.o_tma} <= set(sp) and any(c.o_tma for c in sp)
    assert not any(c.o_tma for c in space("sm90", 128, "fp8_e4m3", False))
    cfgs = [KernelConfig(64, "bf16", False, 128, 128, 12, 2, "sm90", o_tma=True),
            KernelConfig(128, "fp16", True, 128, 128, 12, 2, "sm90", True, True, True, lazy_rescale=True, o_tma=True),
            KernelConfig(128, "bf16", False, 128, 128, 12, 2, "sm90", False, True, True, q_regs=True, o_tma=True),
            KernelConfig(64, "bf16", True, 192, 64, 16, 2, "sm90", True, False, True, overlap_epilogue=True, o_tma=True)]
    for k in compile_sm90a_clean(cfgs):
        assert "cp.async.bulk.global.shared::cta.bulk_group" in k.source and "stmatrix.sync.aligned" in k.source
        assert k.source.count("bulk_wait_all();") == 1
    off = render(plain)  # the bulk-copy helpers are defined in every kernel; this one never takes their branches
    assert "inline constexpr bool O_TMA = false;" in off and "bulk_store(o" not in off and "stsm_x4" not in off


@pytest.mark.sweep
def test_lpt_by_head_rules_name_space_and_clean_compiles():
    """The causal persistent order head by head (lpt_by_head): 16-bit persistent causal dense sm90 only, named _hl,
    in the space beside each persistent causal configuration; the kernel takes tile_at_chunked over whole heads;
    clean compiles with the knobs of the stored causal tiles; renders without it are unchanged."""
    from flashgen.config import ConfigError, space
    from flashgen.render import render

    for bad in ({"persistent": False}, {"causal": False}, {"dtype": "fp8_e4m3"}, {"cluster": True},
                {"pack_gqa": True}):
        args = {"head_dim": 128, "dtype": "bf16", "causal": True, "block_m": 128, "block_n": 128, "num_warps": 12,
                "num_stages": 2, "family": "sm90", "persistent": True, **bad}
        with pytest.raises(ConfigError, match="lpt_by_head is an sm90 knob"):
            KernelConfig(**args, lpt_by_head=True)
    cfg = KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", True, True, True, overlap_epilogue=True,
                       lazy_rescale=True, o_tma=True, lpt_by_head=True)
    plain = dataclasses.replace(cfg, lpt_by_head=False)
    assert cfg.name.endswith("_ps_oe_lz_ot_hl") and KernelConfig.from_dict(cfg.to_dict()) == cfg
    sp = space("sm90", 256, "fp16", True)
    assert {dataclasses.replace(c, lpt_by_head=False) for c in sp if c.lpt_by_head} == {
        c for c in sp if c.persistent and not c.cluster and not c.lpt_by_head}
    assert not any(c.lpt_by_head for c in space("sm90", 128, "bf16", False))
    assert "tile_at_chunked" not in render(plain)
    cfgs = [cfg, KernelConfig(256, "bf16", True, 128, 64, 12, 2, "sm90", True, True, True, lazy_rescale=True,
                              lpt_by_head=True),
            KernelConfig(64, "fp16", True, 128, 128, 12, 4, "sm90", True, False, True, lazy_rescale=True,
                         lpt_by_head=True)]
    for k in compile_sm90a_clean(cfgs):  # every use of the order (producer, consumers) takes the per-head one
        uses = render(dataclasses.replace(k.config, lpt_by_head=False)).count("tile_at(t, m_blocks, p.heads, pairs, IS_CAUSAL)")
        assert uses >= 2 and k.source.count("tile_at_chunked(t, m_blocks, p.heads, pairs, m_blocks)") == uses
        assert "tile_at(t, m_blocks, p.heads, pairs, IS_CAUSAL)" not in k.source


@pytest.mark.sweep
def test_cluster_rules_name_space_grid_and_clean_compiles():
    """2-CTA clusters sharing K/V by TMA multicast (cluster): dense 16-bit sm90 only, named _cl, in the space, the same
    shared memory, K/V boxes of half a tile, m-blocks rounded up to pairs in the grid (persistent: an even grid); ptxas
    keeps the wgmmas asynchronous and spill-free, both masks, d64 and d128, persistent or not, with the other knobs;
    renders without it unchanged."""
    from flashgen.config import ConfigError, space
    from flashgen.render import render

    for bad in (dict(dtype="fp8_e4m3"), dict(family="sm80", num_warps=8), dict(varlen=True), dict(window=True)):
        args = {"head_dim": 128, "dtype": "bf16", "causal": False, "block_m": 128, "block_n": 128, "num_warps": 12,
                "num_stages": 2, "family": "sm90", **bad}
        with pytest.raises(ConfigError, match="dense 16-bit forward"):
            KernelConfig(**args, cluster=True)
    cfg = KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", True, True, lazy_rescale=True, cluster=True)
    plain = dataclasses.replace(cfg, cluster=False)
    assert cfg.name.endswith("_ov1_pp1_lz_cl") and KernelConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.smem_bytes == plain.smem_bytes and (cfg.kv_box_rows, plain.kv_box_rows) == (64, 128)
    assert cfg.grid(batch=3, heads=5, seqlen_q=256) == plain.grid(batch=3, heads=5, seqlen_q=256) == (2 * 15, 1, 1)
    assert cfg.grid(batch=3, heads=5, seqlen_q=257) == (4 * 15, 1, 1) and plain.grid(3, 5, 257) == (3 * 15, 1, 1)
    sp = space("sm90", 64, "fp16", True)
    assert {dataclasses.replace(c, cluster=False) for c in sp if c.cluster} <= set(sp) and any(c.cluster for c in sp)
    assert any(c.cluster and c.persistent for c in sp)
    ps = dataclasses.replace(cfg, persistent=True)
    assert ps.grid(batch=1, heads=8, seqlen_q=4096, sm_count=133) == (132, 1, 1)  # whole clusters
    assert ps.grid(batch=1, heads=1, seqlen_q=300, sm_count=133) == (4, 1, 1)  # 3 m-blocks: 2 pairs
    assert not any(c.cluster for c in space("sm90", 128, "fp8_e4m3", False) + space("sm80", 128, "bf16", False))
    cfgs = [KernelConfig(d, "bf16", causal, 128, 128, 12, 2, "sm90", cluster=True)
            for d in (64, 128) for causal in (False, True)]
    cfgs += [KernelConfig(64, "fp16", True, 128, 128, 12, 2, "sm90", True, True, cluster=True),
             KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", True, False, lazy_rescale=True, cluster=True),
             KernelConfig(128, "bf16", False, 64, 128, 8, 2, "sm90", cluster=True),
             KernelConfig(64, "bf16", True, 192, 64, 16, 2, "sm90", True, cluster=True),
             KernelConfig(128, "fp16", False, 128, 128, 12, 2, "sm90", False, True, q_regs=True, o_tma=True,
                          cluster=True),
             KernelConfig(128, "bf16", True, 128, 64, 12, 3, "sm90", True, lazy_rescale=True, p_smem=True, cluster=True)]
    cfgs += [KernelConfig(128, "bf16", causal, 128, 128, 12, 2, "sm90", persistent=True, cluster=True)
             for causal in (False, True)]
    cfgs += [KernelConfig(64, "fp16", True, 128, 128, 12, 2, "sm90", True, True, True, lazy_rescale=True, cluster=True),
             KernelConfig(128, "bf16", True, 128, 96, 12, 3, "sm90", True, True, True, overlap_epilogue=True, cluster=True),
             KernelConfig(128, "bf16", False, 128, 128, 12, 2, "sm90", False, True, True, q_regs=True, cluster=True),
             KernelConfig(64, "bf16", True, 192, 64, 16, 2, "sm90", True, False, True, overlap_epilogue=True, o_tma=True,
                          cluster=True)]
    for k in compile_sm90a_clean(cfgs):
        assert "__cluster_dims__(2, 1, 1)" in k.source and k.source.count("tma_load_4d_multicast(s") == 2
        for ptx in (".multicast::cluster", "barrier.cluster.arrive", "barrier.cluster.wait", "mapa.shared::cluster",
                    "mbarrier.arrive.shared::cluster.b64"):
            assert ptx in k.source, (k.name, ptx)
        assert k.source.count("cluster_sync();") == 3  # after the barriers' init, the producer's and consumers' ends
    off = render(plain)  # the cluster helpers are defined in every kernel; this one never takes their branches
    assert "inline constexpr bool CLUSTER = false;" in off and "__cluster_dims__" not in off
    assert "tma_load_4d_multicast(s" not in off and "mbar_wait_cluster(bar_free" not in off


_SASS = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)\s*([^;]*);")


def _written(op: str, operands: list[str]) -> set[int]:
    """Registers an instruction writes (its first operand, widened by what its opcode says it writes)."""
    first = operands[0] if operands else ""
    if not re.match(r"R\d", first):
        return set()
    base = int(re.match(r"R(\d+)", first).group(1))
    if op.startswith("HGMMA"):
        width = int(op.split(".")[1].split("x")[1]) // 2  # m64nNk16 with 32-bit accumulators: N/2 per thread
    elif op.startswith("LDSM"):
        width = int(op.rsplit(".", 1)[1])
    else:
        width = 4 if ".128" in op else 2 if (".64" in op or op.startswith(("IMAD.WIDE", "CS2R"))) else 1
    return set(range(base, base + width))


def q_register_clobbers(sass: str) -> list[str]:
    """S = QK^T wgmmas that read Q (their register A operand) from a register that may hold something else: a
    forward must-analysis over the kernel's branches of which registers hold Q, set by ldmatrix and kept by copies
    (MOV, or keep_q's XOR with zero), lost on any other write. Returns the offending wgmmas and the writers."""
    ins, labels = [], {}
    for line in sass.splitlines():
        if (label := re.match(r"^\s*(\.L_x_\d+):", line)):
            labels[label.group(1)] = len(ins)
        elif (m := _SASS.search(line)):
            ins.append((bool(m.group(1)), m.group(2), [o.strip() for o in m.group(3).split(",")]))

    def succ(i: int) -> list[int]:
        pred, op, ops = ins[i]
        to = re.search(r"\((\.L_x_\d+)\)", ops[-1]) if op.startswith("BRA") else None
        nxt = [i + 1] if i + 1 < len(ins) and (pred or not (to or op in ("EXIT", "RET.REL.NODEC", "RET"))) else []
        return nxt + ([labels[to.group(1)]] if to else [])

    def src(ops: list[str], k: int) -> int | None:
        m = re.match(r"R(\d+)", ops[k]) if len(ops) > k else None
        return int(m.group(1)) if m else None

    everything = frozenset(range(256))
    holds = {0: frozenset()}  # instruction -> registers that hold Q on entry, on every path
    last_writer, work, bad = {}, [0], []
    while work:
        i = work.pop()
        q = set(holds[i])
        pred, op, ops = ins[i]
        if op.startswith("HGMMA") and len(ops) > 2 and ops[1].startswith("R") and "tnspB" not in ops[2]:
            a = int(ops[1][1:])
            if not {a, a + 1, a + 2, a + 3} <= q:
                bad.append(f"{op} {', '.join(ops)} after {last_writer.get(a, '?')}")
        out = _written(op, ops)
        copy = (op in ("MOV", "IMAD.MOV.U32") and src(ops, len(ops) - 1) in q
                or op == "LOP3.LUT" and len(ops) > 4 and ops[4] == "0x3c" and src(ops, 1) in q)
        for r in out:
            last_writer[r] = f"{op} {', '.join(ops)}"
        if op.startswith("LDSM") and not pred or copy and not pred:
            q |= out
        else:
            q -= out
        for n in succ(i):
            new = frozenset(q) & holds.get(n, everything)
            if new != holds.get(n):
                holds[n] = new
                work.append(n)
    return sorted(set(bad))


@pytest.mark.sweep
def test_q_regs_keeps_q_registers_through_the_key_loop():
    """With Q in registers, no instruction may reuse Q's registers while a later S = QK^T reads them. ptxas 13.0
    packed P into them in the loop without overlap (d128; wrong output from the second key tile on, on the H200);
    keep_q's XOR makes Q's values live across the loop. Checked in the SASS of the GPU suite's q_regs tiles."""
    from flashgen.compile import disassemble, disassembler

    if disassembler() is None:
        pytest.skip("no nvdisasm or cuobjdump (pip install nvidia-cuda-nvdisasm)")
    tiles = [(128, 128, 12, False, False, False), (128, 128, 12, True, False, False),
             (128, 128, 12, False, True, True), (64, 128, 8, False, False, False)]
    cfgs = [KernelConfig(hd, "bf16", causal, bm, bn, w, 2, "sm90", ov, pp, ps, lazy_rescale=ov, q_regs=True)
            for hd in (64, 128) for causal in (False, True) for bm, bn, w, ov, pp, ps in tiles]
    with ThreadPoolExecutor(max_workers=2) as pool:
        kernels = list(pool.map(lambda c: compile_kernel(c, "sm_90a"), cfgs))
    bad = {k.name: clobbers for k in kernels if (clobbers := q_register_clobbers(disassemble(k.cubin)))}
    assert not bad, bad


@pytest.mark.sweep
def test_p_smem_rules_name_space_and_clean_compiles():
    """P to the second GEMM from shared memory (p_smem): 16-bit sm90 with block_n a multiple of the swizzled row,
    named _psm, in the space, its P tile in the shared memory figure and no second P counted in registers; ptxas
    keeps the wgmmas asynchronous and spill-free at the defaults' tiles in both schedules; renders without it are
    unchanged."""
    from flashgen.config import ConfigError, space
    from flashgen.render import render

    with pytest.raises(ConfigError, match="16-bit"):
        KernelConfig(128, "fp8_e4m3", False, 128, 128, 12, 2, "sm90", p_smem=True)
    with pytest.raises(ConfigError, match="multiple of 64"):
        KernelConfig(128, "bf16", False, 128, 96, 12, 2, "sm90", p_smem=True)
    cfg = KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", True, True, True, lazy_rescale=True, p_smem=True)
    plain = dataclasses.replace(cfg, p_smem=False)
    assert cfg.name.endswith("_ov1_pp1_ps_lz_psm") and KernelConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.smem_bytes == plain.smem_bytes + 2 * 64 * 128 * 2 and cfg.accum_regs == plain.accum_regs - 128 // 4
    sp = space("sm90", 64, "bf16", True)
    assert {dataclasses.replace(c, p_smem=False) for c in sp if c.p_smem} <= set(sp) and any(c.p_smem for c in sp)
    assert not any(c.p_smem for c in space("sm90", 128, "fp8_e4m3", False))
    cfgs = [KernelConfig(hd, dt, causal, 128, 128 if hd < 256 else 64, 12, 2, "sm90", ov, pp, ps, lazy_rescale=ov,
                         p_smem=True)
            for hd in (64, 128, 256) for (dt, causal), (ov, pp, ps) in zip((("bf16", True), ("fp16", False)),
                                                                           ((True, False, False), (False, True, True)))]
    for k in compile_sm90a_clean(cfgs):
        assert "wgmma_pv_ss(o_regs" in k.source and "fence.proxy.async.shared::cta" in k.source
    off = render(dataclasses.replace(cfgs[0], p_smem=False))
    assert "wgmma_pv_ss" not in off and "store_p" not in off


@pytest.mark.sweep
def test_pack_gqa_rules_name_space_and_clean_compiles():
    """sm90 pack_gqa: a dense-forward knob (not a serving feature there), named _pk, offered only in a GQA problem's
    space; ptxas keeps the wgmmas asynchronous and spill-free at d64/d128, both masks, persistent and not, 16-bit and
    FP8; renders without it keep the 4-d Q load."""
    from flashgen.config import ConfigError, space
    from flashgen.render import render

    with pytest.raises(ConfigError, match="dense-forward knob"):
        KernelConfig(128, "bf16", False, 128, 128, 12, 2, "sm90", varlen=True, pack_gqa=True)
    cfg = KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", True, False, True, pack_gqa=True)
    assert cfg.name.endswith("_ov1_pp0_ps_pk") and not cfg.serving and KernelConfig.from_dict(cfg.to_dict()) == cfg
    assert KernelConfig(128, "bf16", False, 64, 64, 4, 2, varlen=True, pack_gqa=True).serving  # sm80: a feature
    mha = space("sm90", 64, "bf16", False)
    assert not any(c.pack_gqa for c in mha) and space("sm90", 64, "bf16", False, 1) == mha
    gqa = space("sm90", 64, "bf16", False, 4)
    assert gqa[:len(mha)] == mha and [dataclasses.replace(c, pack_gqa=False) for c in gqa[len(mha):]] == [
        c for c in mha if not c.o_tma and not c.cluster]  # o_tma stages O by plain rows: not with pack_gqa; nor cluster
    assert all(c.block_m >= 128 for c in space("sm90", 64, "bf16", False, 100) if c.pack_gqa)
    assert not any(c.pack_gqa for c in space("sm80", 64, "bf16", False, 4))
    cfgs = [KernelConfig(hd, dt, causal, 128, 128, 12, 2, "sm90", ov, pp, ps, pack_gqa=True)
            for hd in (64, 128) for (dt, causal), (ov, pp, ps) in zip((("bf16", True), ("fp16", False), ("bf16", False),
                                                                      ("bf16", True)),
                                                                     ((False, False, False), (True, False, False),
                                                                      (False, True, True), (True, False, True)))]
    cfgs += [KernelConfig(128, "fp8_e4m3", True, 128, 128, 12, 2, "sm90", True, pack_gqa=True),
             KernelConfig(64, "fp8_e4m3", False, 128, 128, 12, 2, "sm90", True, False, True, pack_gqa=True)]
    for k in compile_sm90a_clean(cfgs):
        assert "tma_load_5d(" in k.source and "apply_mask_q(" in k.source and "pos = BLOCK_M / group" in k.source
        assert ("tile_at_chunked(t, m_blocks, p.heads_k, pairs, chunk)" in k.source) == k.config.persistent
    off = render(dataclasses.replace(cfgs[0], pack_gqa=False))
    assert "tma_load_5d" not in off and "row_q" not in off and "pos = BLOCK_M / group" not in off
