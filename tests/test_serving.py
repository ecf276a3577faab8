"""Serving kernels without a GPU: configuration rules, the split-KV choice, rendering and compiling
(sm_80 and sm_90a), and the argument checks that need no device data."""
from __future__ import annotations

import ctypes
import dataclasses
import re

import pytest

from flashgen import abi
from flashgen.checks import Mods
from flashgen.compile import compile_kernel
from flashgen.config import FEATURES, ConfigError, KernelConfig, space
from flashgen.render import render
from flashgen.kernels.serving import MAX_SPLITS, choose_splits, serve_config, serve_grids


def test_features_name_the_kernel_and_dense_names_stay():
    dense = KernelConfig(128, "bf16", True, 128, 64, 8, 2)
    assert dense.name == "fwd_sm80_d128_bf16_causal_bm128_bn64_w8_s2" and not dense.serving
    cfg = KernelConfig(128, "bf16", False, 16, 64, 1, 3, varlen=True, paged=True, split=True, pack_gqa=True)
    assert cfg.name.endswith("_vl_pg_sp_pk") and cfg.features == ("varlen", "paged", "split", "pack_gqa")
    assert cfg.kernel_names == {"main": cfg.name, "combine": cfg.name + "_combine"}
    assert KernelConfig.from_dict(cfg.to_dict()) == cfg


def test_feature_rules():
    with pytest.raises(ConfigError, match="family sm80"):
        KernelConfig(128, "bf16", False, 128, 128, 12, 2, "sm90", varlen=True, paged=True)
    with pytest.raises(ConfigError, match="non-persistent kernels"):
        KernelConfig(128, "bf16", False, 128, 128, 12, 2, "sm90", persistent=True, varlen=True)
    assert KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", persistent=True, window=True).name.endswith("_ps_win")
    with pytest.raises(ConfigError, match="16-bit kernels"):
        KernelConfig(128, "fp8_e4m3", False, 128, 128, 12, 2, "sm90", window=True)
    cfg = KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", varlen=True, window=True)
    assert cfg.name == "fwd_sm90_d128_bf16_causal_bm128_bn128_w12_s2_ov0_pp0_vl_win"
    with pytest.raises(ConfigError, match="paged=True needs varlen"):
        KernelConfig(128, "bf16", False, 64, 64, 4, 2, paged=True)
    with pytest.raises(ConfigError, match="pack_gqa and alibi"):
        KernelConfig(128, "bf16", False, 64, 64, 4, 2, varlen=True, pack_gqa=True, alibi=True)


def test_dense_spaces_keep_out_decode_tiles():
    for cfg in space("sm80", 128, "bf16", False):
        assert cfg.block_m >= 64 and cfg.num_warps > 1 and not cfg.serving


def test_split_choice_fills_the_gpu_and_stays_one_when_full():
    assert choose_splits(tiles=264, slots=264, n_blocks=128) == 1  # the tiles alone fill every slot
    s = choose_splits(tiles=8, slots=264, n_blocks=2048)  # batch 1, 8 KV heads, a 128k cache
    assert 16 <= s <= MAX_SPLITS and (8 * s) / 264 > 0.8 * -(-(8 * s) // 264)
    assert choose_splits(tiles=8, slots=264, n_blocks=3) <= 3  # never more splits than key blocks
    assert choose_splits(tiles=1, slots=264, n_blocks=1) == 1


@pytest.mark.parametrize("rows,bm", [(1, 32), (16, 32), (17, 32), (32, 32), (300, 128)])
def test_serve_config_follows_rows(rows, bm):
    cfg = serve_config(128, "bf16", False, rows, "sm90", varlen=True, pack_gqa=rows <= 32)
    assert cfg.block_m == bm and cfg.unfit_reason("sm90") is None


FEATURE_SETS = [
    dict(varlen=True, paged=True, split=True, pack_gqa=True),
    dict(varlen=True, window=True, softcap=True, alibi=True),
]


@pytest.mark.parametrize("target", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("features", FEATURE_SETS, ids=["decode", "mods"])
def test_serving_kernels_compile_without_spills(target, features, tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path))
    rows = 4 if features.get("pack_gqa") else 300
    cfg = serve_config(128, "bf16", not features.get("pack_gqa"), rows, "sm80", **features)
    src = render(cfg)
    assert f"{cfg.name}(const __grid_constant__ ServeParams p)" in src
    assert ("_combine(" in src) == cfg.split
    res = compile_kernel(cfg, target).resources
    assert not res.spills, f"{cfg.name} spills on {target}: {res}"


@pytest.mark.parametrize("knobs", [dict(), dict(overlap=True), dict(pingpong=True), dict(overlap=True, pingpong=True)],
                         ids=["plain", "overlap", "pingpong", "both"])
@pytest.mark.parametrize("features", [dict(varlen=True), dict(varlen=True, window=True), dict(window=True),
                                      dict(window=True, persistent=True)],
                         ids=["varlen", "varlen-window", "window", "persistent-window"])
def test_sm90_serving_forward_compiles_without_spills(knobs, features, tmp_path, monkeypatch):
    """The sm90 family's varlen / window forward: each schedule compiles for sm_90a, no spill, no serialized wgmma;
    its params struct is the host's (static_assert on offsets and size)."""
    import re

    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path))
    cfg = KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", **knobs, **features)
    assert "(const __grid_constant__ Sm90ServeFwdParams p)" in render(cfg)
    k = compile_kernel(cfg, "sm_90a")
    assert not k.resources.spills and not re.search(r"C751[239]", k.ptxas_log), f"{cfg.name}: {k.resources}"


def test_every_feature_renders_alone():
    for f in FEATURES:
        extra = {"varlen": True} if f == "paged" else {}
        cfg = KernelConfig(64, "fp16", True, 64, 64, 4, 2, **{f: True, **extra})
        assert f"constexpr bool {'PACK_GQA' if f == 'pack_gqa' else f.upper()} = true;" in render(cfg)


def test_serve_grids_follow_the_kernels_block_unfolding():
    dec = serve_config(128, "bf16", False, 4, "sm80", varlen=True, paged=True, split=True, pack_gqa=True)
    # 1 query row x 4 heads per KV head packed into one 32-row block, per KV head, sequence and split.
    assert serve_grids(dec, batch=3, heads=32, heads_k=8, seqlen_q=1, total_rows=3, num_splits=5) == (8 * 3 * 5, 24)
    assert serve_grids(dec, batch=1, heads=32, heads_k=8, seqlen_q=9, total_rows=9, num_splits=1) == (16, 72)
    pre = serve_config(128, "bf16", True, 1000, "sm80", varlen=True, window=True)
    # no split: num_splits does not multiply the grid, and there is no combine
    assert serve_grids(pre, batch=2, heads=8, heads_k=2, seqlen_q=1000, total_rows=1500, num_splits=4) == (8 * 8 * 2, 0)


def test_decode_tiles_fit_every_arch():
    """The 3-stage d128 decode tile needs 104 KB of shared memory: sm86/sm89 (99 KB) get fewer stages."""
    from flashgen.config import ARCHS
    from flashgen.kernels.serving import serve_config

    for arch in ARCHS:
        for d in (32, 64, 96, 128, 256):
            cfg = serve_config(d, "bf16", True, 1, arch, varlen=True, paged=True, split=True)
            assert cfg.unfit_reason(arch) is None and cfg.block_m == 32, (arch, d)
    assert serve_config(128, "bf16", False, 1, "sm90", varlen=True).num_stages == 3
    assert serve_config(128, "bf16", False, 1, "sm86", varlen=True).num_stages < 3


def test_plan_keys_only_for_calls_a_plan_can_repeat():
    """attention_with_kvcache's plan: keyed by shapes, strides, dtypes, devices and options; none for tensors of
    another type, an int cache_seqlens or options of other types (the full path checks those every call)."""
    torch = pytest.importorskip("torch")
    from flashgen.api import _NO_WINDOW, _plan_key

    q = torch.empty(2, 1, 8, 64, dtype=torch.bfloat16)
    kc = torch.empty(2, 128, 2, 64, dtype=torch.bfloat16)
    lens = torch.zeros(2, dtype=torch.int32)
    args = dict(block_table=None, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, num_splits=1,
                return_lse=False)
    key = _plan_key(q, kc, kc, lens, **args)
    assert key is not None and key == _plan_key(q, kc, kc, lens.clone(), **args)
    assert key == _plan_key(q.clone(), kc.clone(), kc.clone(), lens, **{**args, "window_size": _NO_WINDOW})
    assert key == _plan_key(q, kc, kc, lens, **{**args, "causal": 0, "softcap": 0})  # equal values, one plan
    for other in ({"causal": True}, {"num_splits": 2}, {"softmax_scale": 0.5}, {"window_size": (8, 0)},
                  {"softcap": 30.0}, {"return_lse": True}):
        assert key != _plan_key(q, kc, kc, lens, **{**args, **other}), other
    assert key != _plan_key(q, kc.transpose(1, 2).contiguous().transpose(1, 2), kc, lens, **args)  # strides
    assert key != _plan_key(q, kc, kc[:, :64], lens, **args)  # v's shape
    assert key != _plan_key(q.half(), kc, kc, lens, **args)
    assert key != _plan_key(q, kc, kc, lens.long(), **args)
    assert key != _plan_key(q, kc, kc, lens, **{**args, "block_table": torch.zeros(2, 4, dtype=torch.int32)})
    assert key != _plan_key(q, kc, kc, torch.zeros(2, dtype=torch.int32, device="meta"), **args)  # its device
    assert _plan_key(q, kc, kc, 5, **args) is None
    assert _plan_key(q, kc, kc, None, **args) is None
    assert _plan_key(torch.nn.Parameter(q), kc, kc, lens, **args) is None  # a subclass: the full path decides
    for bad in ({"causal": "yes"}, {"softmax_scale": torch.tensor(0.5)}, {"window_size": [-1, -1]},
                {"window_size": (-1.0, -1)}, {"num_splits": 2.0}, {"softcap": None}, {"block_table": [[0]]}):
        assert _plan_key(q, kc, kc, lens, **{**args, **bad}) is None, bad


class PlanLaunches:
    """Stands in for the driver under kvcache_launch (through _fire) and run_plan (through driver.Prepared): each
    launch recorded as (role, grid, threads, ServeParams's values, stream), and in `programmatic` whether it has
    programmatic stream serialization."""

    def __init__(self, monkeypatch, serving, torch):
        self.launches: list = []
        self.programmatic: list = []
        self.counters: dict = {}
        launches, programmatic = self.launches, self.programmatic

        class Fn:
            def __init__(self, role):
                self.role = role

            def launch(self, grid, threads, params, stream, pdl=False):
                fields = serving.SERVE_PARAMS.unpack(params[:serving.SERVE_PARAMS.size])
                launches.append((self.role, grid, threads, fields, stream))
                programmatic.append(pdl)

            def prepared(self, grid, threads, pdl=False):
                role = self.role

                class Launch:
                    def launch(self, stream, kernel_params):
                        buf = serving.driver.thread_state()[0]
                        assert ctypes.cast(kernel_params, ctypes.POINTER(ctypes.c_void_p))[0] == ctypes.addressof(buf)
                        params = buf.raw[:serving.SERVE_PARAMS.size]
                        launches.append((role, grid, threads, serving.SERVE_PARAMS.unpack(params), stream))
                        programmatic.append(pdl)
                return Launch()

        monkeypatch.setattr(serving, "_functions", lambda cfg, arch, ctx: (
            Fn("main"), Fn("combine") if "combine" in cfg.kernel_names else None))
        monkeypatch.setattr(serving, "arch_and_slots", lambda device: ("sm90", 132))
        monkeypatch.setattr(serving.driver, "use_device", lambda device: None)
        monkeypatch.setattr(serving.driver, "make_current", lambda ctx, state=None: None)
        monkeypatch.setattr(serving.driver, "primary_context", lambda device: 0x1000)
        monkeypatch.setattr(serving.driver, "primary_context_id", lambda device: 1)
        monkeypatch.setattr(serving, "current_stream", lambda device: self.stream)
        monkeypatch.setattr(serving, "error_word", lambda device: 0x5000)
        monkeypatch.setattr(serving, "capturing", lambda: False)
        monkeypatch.setattr(serving, "_workspaces", {})
        real_empty = torch.empty
        monkeypatch.setattr(serving, "_workspace", lambda device, stream, floats, fresh: serving._workspaces.setdefault(
            (device, stream), real_empty(floats)))
        monkeypatch.setattr(serving, "_tile_counters", lambda device, stream, n, fresh: self.counters.setdefault(
            (stream, n), torch.zeros(n, dtype=torch.int32)))
        self.stream = 7


def test_a_plan_launches_the_struct_the_full_path_packed(monkeypatch):
    """run_plan repeats kvcache_launch's ServeParams: every field but out, lse and the split buffers (fresh per
    call) the same bytes, for split and unsplit, paged and contiguous launches, on the same grids and stream
    (driver calls recorded, no GPU). Split-KV launches, whose kernels wait for the grid before them themselves, have
    programmatic stream serialization on both paths; the others none."""
    torch = pytest.importorskip("torch")
    from flashgen.kernels import serving

    got = PlanLaunches(monkeypatch, serving, torch)
    q = torch.randn(3, 1, 8, 128, dtype=torch.bfloat16)
    lens = torch.tensor([5, 64, 200], dtype=torch.int32)
    fresh = {3, 4, 29, 30}  # out, lse, o_accum, lse_accum
    counts = abi.SERVE.index("tile_counts")
    for paged, splits, fused in ((False, 1, False), (False, 4, False), (True, 1, False), (True, 4, False),
                                 (False, 4, True), (True, 4, True)):
        kc = torch.randn(12 if paged else 3, 16 if paged else 256, 2, 128, dtype=torch.bfloat16)
        table = torch.arange(12, dtype=torch.int32).view(3, 4) if paged else None
        cfg = serve_config(128, "bf16", False, 4, "sm90", varlen=True, paged=paged, pack_gqa=True, split=splits > 1)
        cfg = dataclasses.replace(cfg, fused_combine=fused)
        got.launches.clear()
        got.programmatic.clear()
        run = serving.kvcache_launch(cfg, splits, q, kc, kc, torch.empty_like(q), torch.empty(3, 8, 1), lens, table)
        full = list(got.launches)
        got.launches.clear()
        out, lse = serving.run_plan(serving.KVPlan(run, (3, 8, 1)), q, kc, kc, lens, table, True)
        assert out.shape == q.shape and out.is_contiguous() and lse.shape == (3, 8, 1)
        assert len(full) == len(got.launches) == (2 if splits > 1 and not fused else 1)
        assert got.programmatic == [splits > 1] * (2 * len(full))
        for (role_a, grid_a, thr_a, a, st_a), (role_b, grid_b, thr_b, b, st_b) in zip(full, got.launches):
            assert (role_a, grid_a, thr_a, st_a) == (role_b, grid_b, thr_b, st_b)
            assert [x for i, x in enumerate(a) if i not in fresh] == [x for i, x in enumerate(b) if i not in fresh]
            assert b[3] == out.data_ptr() and b[4] == lse.data_ptr() and b[26] == lens.data_ptr()
            assert b[27] == (table.data_ptr() if paged else 0)
            assert splits == 1 or all(b[i] != 0 for i in (29, 30))
            # fused: one counter per row block (the grid over the splits), all zero; otherwise none
            assert b[counts] == (got.counters[7, grid_b[0] // splits].data_ptr() if fused else 0)
    sinks, at = torch.randn(8), abi.SERVE.index("sinks")  # fp32: the kernel reads the caller's own tensor
    for given in (sinks, torch.randn(8)):  # the plan's call, then another call's sinks: its pointer
        kc = torch.randn(3, 256, 2, 128, dtype=torch.bfloat16)
        cfg = serve_config(128, "bf16", False, 4, "sm90", varlen=True, pack_gqa=True, sinks=True)
        got.launches.clear()
        run = serving.kvcache_launch(cfg, 1, q, kc, kc, torch.empty_like(q), None, lens, None, Mods(sinks=sinks))
        serving.run_plan(serving.KVPlan(run, None), q, kc, kc, lens, None, False, given)
        (_, _, _, a, _), (_, _, _, b, _) = got.launches
        assert a[at] == sinks.data_ptr() and b[at] == given.data_ptr()
        assert [x for i, x in enumerate(a) if i not in fresh | {at}] == [x for i, x in enumerate(b) if i not in fresh | {at}]


def test_a_plans_split_scratch_is_its_streams(monkeypatch):
    """One plan launched on two streams: each stream's launches read and write that stream's accumulators (and
    fused-combine counters), never the other's; back on the first stream, the first's again."""
    torch = pytest.importorskip("torch")
    from flashgen.kernels import serving

    got = PlanLaunches(monkeypatch, serving, torch)
    q = torch.randn(1, 1, 8, 128, dtype=torch.bfloat16)
    kc = torch.randn(1, 1024, 2, 128, dtype=torch.bfloat16)
    lens = torch.tensor([1000], dtype=torch.int32)
    cfg = dataclasses.replace(serve_config(128, "bf16", False, 4, "sm90", varlen=True, pack_gqa=True, split=True),
                              fused_combine=True)
    plan = serving.KVPlan(serving.kvcache_launch(cfg, 8, q, kc, kc, torch.empty_like(q), None, lens, None), None)
    scratch = {}
    for stream in (7, 9, 7):
        got.stream = stream
        got.launches.clear()
        serving.run_plan(plan, q, kc, kc, lens, None, False)
        (_, _, _, fields, st), = got.launches
        held = serving._workspaces[plan.launch.device, stream].data_ptr()
        scratch.setdefault(stream, (held, fields[abi.SERVE.index("tile_counts")]))
        assert st == stream and (fields[29], fields[abi.SERVE.index("tile_counts")]) == scratch[stream]
    assert scratch[7][0] != scratch[9][0] and scratch[7][1] != scratch[9][1]


def test_fused_combine_counters_are_zeroed_and_held_per_stream(monkeypatch):
    """The fused combine's arrival counters: zero when made, one buffer per (device, stream) grown as needed (a
    launch leaves its counters zero, so a held buffer serves the next launch), zeroed ones of its own in a capture."""
    torch = pytest.importorskip("torch")
    from flashgen.kernels import serving

    made = []
    real_zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda n, dtype, device: made.append(n) or real_zeros(n, dtype=dtype))
    monkeypatch.setattr(serving, "_counters", {})
    a = serving._tile_counters(0, 7, 40, False)
    assert a.dtype == torch.int32 and not a.any() and serving._tile_counters(0, 7, 8, False) is a and made == [40]
    assert serving._tile_counters(0, 8, 8, False) is not a and made == [40, 8]
    grown = serving._tile_counters(0, 7, 100, False)
    assert grown.numel() == 100 and made == [40, 8, 100]
    assert serving._tile_counters(0, 7, 4, True) is not serving._tile_counters(0, 7, 4, True) and made[-2:] == [4, 4]
    assert serving._counters[0, 7] is grown


def test_fused_combine_config():
    cfg = KernelConfig(128, "bf16", False, 32, 64, 2, 2, varlen=True, pack_gqa=True, split=True, fused_combine=True)
    assert cfg.name.endswith("_sp_pk_fc") and cfg.kernel_names == {"main": cfg.name}
    assert dataclasses.replace(cfg, fused_combine=False).kernel_names["combine"].endswith("_pk_combine")
    for bad in ({"split": False}, {"mask_mod": "ab12"}):
        with pytest.raises(ValueError, match="fused_combine"):
            dataclasses.replace(cfg, **bad)


def test_split_accumulators_are_held_per_stream(monkeypatch):
    """Split-KV scratch: one allocation per (device, stream), grown when a larger launch needs more; fresh (not held)
    inside a CUDA-graph capture, where the graph's pool owns it, and above the size flashgen keeps."""
    torch = pytest.importorskip("torch")
    from flashgen.kernels import serving

    made = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda n, dtype, device: made.append(n) or real_empty(n, dtype=dtype))
    monkeypatch.setattr(serving, "_workspaces", {})
    a = serving._workspace(0, 7, 100, False)
    assert serving._workspace(0, 7, 50, False) is a and made == [100]  # held on stream 7
    assert serving._workspace(0, 8, 100, False) is not a and made == [100, 100]  # another stream, its own
    grown = serving._workspace(0, 7, 300, False)
    assert grown.numel() == 300 and serving._workspace(0, 7, 100, False) is grown and made == [100, 100, 300]
    assert serving._workspace(0, 7, 10, True) is not serving._workspace(0, 7, 10, True) and made[-2:] == [10, 10]
    assert serving._workspaces[0, 7] is grown  # a capture's scratch is not held for eager calls
    big = serving._WORKSPACE_KEEP // 4 + 1
    serving._workspace(0, 7, big, False)
    assert made[-1] == big and serving._workspaces[0, 7] is grown


def test_fused_combine_builds_one_kernel_that_merges():
    """A fused-combine decode kernel compiles (sm_80 and Hopper) to one __global__ function, without spills at the
    stored contiguous tile, arriving on its row block's counter by an atomic add, and reading the other splits'
    partials from L2 (ld.global.cg)."""
    from flashgen.compile import disassemble, disassembler
    from flashgen.kernels.serving import decode_config

    cfg = dataclasses.replace(decode_config(128, "bf16", (32, 64, 2, 2), False, True), fused_combine=True)
    src = render(cfg)
    assert "_combine(" not in src and "combine_if_last(p)" in src and "__ldcg" in src
    for target in ("sm_80", "sm_90"):
        kern = compile_kernel(cfg, target)
        assert kern.resources.spills == 0, (target, kern.resources)
        if disassembler() is not None:
            sass = disassemble(kern.cubin)
            assert f".text.{cfg.name}_combine" not in sass and re.search(r"\bATOMG?\.E\.ADD", sass) and "STRONG.GPU" in sass


def test_split_kernels_wait_for_the_grid_before_them_before_touching_memory():
    """The split-KV kernels launch with programmatic stream serialization (their blocks may start while the grid
    before them runs), so each of their __global__ functions must wait for that grid (griddepcontrol.wait: ACQBULK
    in sm_90 SASS) before its first global load or store, and only then let the next launch in (PREEXIT). On sm_80
    they compile to nothing. The unsplit serving kernels, launched without the attribute, have neither."""
    from flashgen.compile import disassemble, disassembler
    from flashgen.kernels.serving import decode_config

    split = decode_config(128, "bf16", (32, 64, 2, 2), False, True)
    unsplit = decode_config(128, "bf16", (16, 32, 1, 3), False, False)
    assert split.split and not unsplit.split
    assert "griddepcontrol" in render(split) and "griddepcontrol" not in render(unsplit)
    if disassembler() is None:
        pytest.skip("no SASS disassembler")
    memory = re.compile(r"\b(LDG|STG|LDGSTS|ATOMG|RED|LD|ST)\b")
    for cfg, waits in ((split, True), (unsplit, False), (dataclasses.replace(split, fused_combine=True), True)):
        sass = disassemble(compile_kernel(cfg, "sm_90").cubin)
        functions = re.split(r"\.text\.(\w+):", sass)[1:]
        names = functions[0::2]
        assert (f"{cfg.name}_combine" in names) == (cfg.split and not cfg.fused_combine) and cfg.name in names
        for name, body in zip(names, functions[1::2]):
            ops = [line.split(";")[0].split()[1:] for line in body.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]
            ops = [op[1] if op and op[0].startswith("@") and len(op) > 1 else (op[0] if op else "") for op in ops]
            ops = [op.split(".")[0] for op in ops]
            if not waits:
                assert "ACQBULK" not in ops and "PREEXIT" not in ops, name
                continue
            first_memory = next(i for i, op in enumerate(ops) if memory.fullmatch(op))
            assert ops.index("ACQBULK") < ops.index("PREEXIT") < first_memory, name
        assert "ACQBULK" not in disassemble(compile_kernel(cfg, "sm_80").cubin)


def test_the_combine_loads_its_first_splits_before_it_reduces_their_lses():
    """The combine kernel's first batch of partial-O loads (16 splits x head_dim / 32 per lane) does not depend on the
    LSEs: all of them are issued before the LSE reduction's first shuffle, so up to 16 splits cost one round trip
    to L2 (sm_90 SASS; nothing spilled, nothing in local memory)."""
    from flashgen.compile import disassemble, disassembler
    from flashgen.kernels.serving import decode_config

    cfg = decode_config(128, "bf16", (32, 64, 2, 2), False, True)
    kern = compile_kernel(cfg, "sm_90")
    assert kern.resources.spills == 0
    if disassembler() is None:
        pytest.skip("no SASS disassembler")
    sass = disassemble(kern.cubin)
    functions = re.split(r"\.text\.(\w+):", sass)[1:]
    body = dict(zip(functions[0::2], functions[1::2]))[f"{cfg.name}_combine"]
    ops = [m.group(1) for m in re.finditer(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9]+)", body, re.M)]
    first_shuffle = ops.index("SHFL")
    assert ops[:first_shuffle].count("LDG") >= 16 * 128 // 32 + 1  # the batch, and the LSE
    assert "LDL" not in ops and "STL" not in ops
