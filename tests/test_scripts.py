"""The measurement scripts' host-side logic, without a GPU: kernel names read back, stall profiles summarized."""
from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path

import pytest

from flashgen.config import BwdConfig, KernelConfig, bwd_space
from flashgen.store import read_store

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import profile_stalls  # noqa: E402
import time_configs  # noqa: E402


@pytest.mark.parametrize("cfg", [
    KernelConfig(128, "bf16", True, 128, 176, 12, 2, "sm90", True, False, True, overlap_epilogue=True),
    KernelConfig(128, "fp8_e4m3", False, 128, 256, 12, 2, "sm90", persistent=True, mma_rowsum=True),
    KernelConfig(64, "fp8_e4m3", True, 192, 128, 16, 2, "sm90", persistent=True, block_quant_p=True, mma_rowsum=True,
                 out_dtype="fp16"),
    KernelConfig(256, "fp16", False, 128, 64, 8, 2),
    KernelConfig(256, "bf16", True, 128, 64, 12, 2, "sm90", True, False, True, lazy_rescale=True),
    KernelConfig(128, "fp8_e4m3", False, 128, 256, 12, 2, "sm90", persistent=True, mma_rowsum=True, lazy_rescale=True),
    KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", True, True, True, lazy_rescale=True, q_regs=True),
    KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", True, True, True, lazy_rescale=True, p_smem=True),
    KernelConfig(64, "fp16", False, 128, 128, 12, 2, "sm90", True, lazy_rescale=True, q_regs=True, p_smem=True),
    KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", True, True, True, lazy_rescale=True, o_tma=True),
    KernelConfig(128, "bf16", False, 128, 128, 12, 2, "sm90", True, False, True, pack_gqa=True),
    KernelConfig(128, "bf16", True, 128, 128, 12, 2, "sm90", True, True, True, lazy_rescale=True, lpt_by_head=True,
                 desc_step=True),
    KernelConfig(64, "bf16", False, 128, 128, 12, 2, "sm90", exp2_fma=2, desc_step=True, pack_gqa=True),
    KernelConfig(128, "fp8_e4m3", False, 128, 256, 12, 2, "sm90", persistent=True, mma_rowsum=True, desc_step=True),
])
def test_a_kernel_name_reads_back_as_its_configuration(cfg):
    assert time_configs.parse(cfg.name) == cfg


def test_store_names_read_the_tuned_entry():
    path = Path(__file__).resolve().parent.parent / "tuned" / "nvidia-h200-sm90.json"
    key, entry = next((k, e) for k, e in read_store(path)["entries"].items() if "fp8" in k)
    assert time_configs.parse(f"store:{key}").to_dict() == KernelConfig.from_dict(entry["config"]).to_dict()
    with pytest.raises(SystemExit, match="no tuned entry"):
        time_configs.parse("store:no_such_problem")


def test_a_stored_backward_reads_back_with_a_knob_changed():
    """store:KEY of a backward entry is its BwdConfig (timed as a backward), +field=value changes one knob, and a
    field the configuration lacks is refused by name."""
    path = Path(__file__).resolve().parent.parent / "tuned" / "nvidia-h200-sm90.json"
    key, entry = next((k, e) for k, e in read_store(path)["entries"].items()
                      if k.startswith("sm90_d64_bf16_full") and k.endswith("_bwd"))
    cfg = time_configs.with_knobs(f"store:{key}")
    assert isinstance(cfg, BwdConfig) and cfg.to_dict() == BwdConfig.from_dict(entry["config"]).to_dict()
    on = time_configs.with_knobs(f"store:{key}+dq_tma=true")
    assert on == dataclasses.replace(cfg, dq_tma=True) and "_dqt" in on.name and on.name.replace("_dqt", "") == cfg.name
    with pytest.raises(SystemExit, match="BwdConfig has no field overlap"):
        time_configs.with_knobs(f"store:{key}+overlap=true")


CSV = '''"Kernel Name","fwd_x",
"Address","Source","Warp Stall Sampling (All Samples)","stall_barrier","stall_wait"
"0x10","      S2R R0, SR_TID.X","5","0","5"
"0x20","      USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe8","0","0","0"
"0x30","      QGMMA.64x256x32.F32.E4M3.E4M3 R24, gdesc[UR28], RZ, !UPT","10","0","10"
"0x40","      WARPGROUP.DEPBAR.LE gsb0, 0x0","40","40","0"
"0x50","      MUFU.EX2 R50, R50","30","0","30"
"0x60","      SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR9+0x34050], R4","5","0","5"
"0x70","  @!P0  BRA 0x7f","15","0","15"
"0x80","      USETMAXREG.DEALLOC.CTAPOOL 0x28","0","0","0"
"0x90","      LDSM.16.MT88.4 R8, [R8]","100","0","100"
'''


def test_stall_summary_splits_the_consumer_warpgroups_samples_by_what_they_wait_on(capsys):
    profile_stalls.summarize(CSV, "synthetic", top=3)
    out = capsys.readouterr().out
    # consumer region: from setmaxnreg.inc to the producer's setmaxnreg.dec, 100 of the 205 samples
    assert "consumer warps' samples (49% of all)" in out
    assert "gemm wait 40.0%" in out and "MUFU 30.0%" in out and "mbarrier wait 20.0%" in out and "gemm issue" + " 10.0%" in out
    assert "LDSM" in out.splitlines()[2]  # the most sampled instruction first (the producer's)


def test_fp8_softmax_emulation_keeps_the_kernel_when_no_max_moves():
    """The emulation behind FP8 lazy rescaling's design: skipping the rescale only when no row's max grew is the
    plain kernel exactly; a power-of-two offset changes nothing; a slack changes the answer."""
    torch = pytest.importorskip("torch", reason="the FP8 emulation needs torch (a CPU build is enough)")
    import fp8_softmax_emulation as emu

    torch.manual_seed(0)
    q, k, v = (emu.quantized(torch.randn(1, n, 2, 64)) for n in (32, 300, 300))
    plain = emu.kernel_emulation(q, k, v, True)
    assert torch.equal(emu.kernel_emulation(q, k, v, True, slack=0.0), plain)
    assert torch.allclose(emu.kernel_emulation(q, k, v, True, offset=6.0), plain, rtol=1e-6, atol=0)
    assert not torch.allclose(emu.kernel_emulation(q, k, v, True, slack=0.8), plain, rtol=1e-4, atol=0)


@pytest.mark.sweep  # needs the disassembler the sweep installs (the sass extra)
def test_same_sass_reads_instructions_and_tells_kernels_apart():
    from flashgen.compile import compile_kernel, disassembler

    import same_sass

    if disassembler() is None:
        pytest.skip("no nvdisasm or cuobjdump (pip install nvidia-cuda-nvdisasm)")
    a = compile_kernel(KernelConfig(64, "bf16", False, 128, 64, 4, 2), "sm_80")
    b = compile_kernel(KernelConfig(64, "bf16", True, 128, 64, 4, 2), "sm_80")
    assert same_sass.sass_digest(a.cubin) == same_sass.sass_digest(a.cubin)
    assert same_sass.sass_digest(a.cubin) != same_sass.sass_digest(b.cubin)


SKIP_SOURCE = """\
extern "C" __global__ void k(float* x, int n) {{
    for (int i = threadIdx.x; i < n; i += blockDim.x) if (x[i] > 0.f) x[i] = sqrtf(x[i]);
}}
extern "C" __global__ void k_pre(float* x, int n) {{ {pre} }}
"""


@pytest.mark.sweep  # needs the disassembler the sweep installs (the sass extra)
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_same_sass_can_leave_functions_out(tmp_path):
    """--skip-functions: two cubins whose _pre functions differ (one with a loop, which renumbers the file's branch
    labels) have the same digest without them, and different ones with them."""
    import subprocess

    from flashgen.compile import disassembler

    import same_sass

    if disassembler() is None:
        pytest.skip("no nvdisasm or cuobjdump (pip install nvidia-cuda-nvdisasm)")
    cubins = []
    for i, pre in enumerate(("x[threadIdx.x] += 1.f;",
                             "for (int i = threadIdx.x; i < n; i += 32) if (x[i] < 0.f) x[i] = 2.f * x[i];")):
        (tmp_path / f"{i}.cu").write_text(SKIP_SOURCE.format(pre=pre))
        subprocess.run(["nvcc", "-cubin", "-arch=sm_80", "-o", str(tmp_path / f"{i}.cubin"), str(tmp_path / f"{i}.cu")],
                       check=True, capture_output=True)
        cubins.append((tmp_path / f"{i}.cubin").read_bytes())
    assert same_sass.sass_digest(cubins[0]) != same_sass.sass_digest(cubins[1])
    assert same_sass.sass_digest(cubins[0], ("_pre",)) == same_sass.sass_digest(cubins[1], ("_pre",))


def test_fill_kernel_cache_space_is_the_restricted_tune_space():
    """--space head_dim=64 dtype=bf16 block_m=192 block_n=128,192 names what `tune --block-m 192 --block-n 128,192`
    evaluates at d64 bf16, both masks: the fitting configurations of the family's space with those values."""
    import fill_kernel_cache
    from flashgen.config import space

    r = fill_kernel_cache.parse_restrictions(["head_dim=64", "dtype=bf16", "block_m=192", "block_n=128,192",
                                              "persistent=yes"])
    assert r == {"head_dim": [64], "dtype": ["bf16"], "block_m": [192], "block_n": [128, 192], "persistent": [True]}
    got = fill_kernel_cache.space_configs("sm90", r)
    want = {c for causal in (False, True) for c in space("sm90", 64, "bf16", causal)
            if c.block_m == 192 and c.block_n in (128, 192) and c.persistent and c.unfit_reason("sm90") is None}
    assert got == want and {c.causal for c in got} == {False, True} and len(got) > 10


def test_fill_kernel_cache_flex_names_each_cases_modifier_kernels(monkeypatch):
    """--flex: the bench's modifier cases' forward and backward, both families on sm90 (the sm90 family's where its
    schedules build clean, here all of them, but for the band masks, which the built-in kernels run), the sm80
    family's alone on sm80; the plain kernels are not its."""
    pytest.importorskip("torch")
    import fill_kernel_cache
    from flashgen import bench_flex
    from flashgen.config import BwdConfig
    from flashgen.kernels import serving

    monkeypatch.setattr(serving, "_builds_clean", lambda cfg, spill_slack=0: True)
    serving._sm90_modifier_config.cache_clear()
    try:
        hopper, ampere = fill_kernel_cache.flex_configs("sm90"), fill_kernel_cache.flex_configs("sm80")
    finally:
        serving._sm90_modifier_config.cache_clear()
    kinds = {(isinstance(c, BwdConfig), c.family) for c in hopper}
    assert kinds == {(False, "sm80"), (False, "sm90"), (True, "sm80"), (True, "sm90")}
    assert {c.family for c in ampere} == {"sm80"} and all(c.score_mod or c.mask_mod for c in hopper | ampere)
    assert all(c.head_dim == 128 and c.dtype == "bf16" for c in hopper | ampere)
    assert any(c.block_map for c in hopper) and any(not c.block_map for c in hopper)  # masks and score_mods alone
    # causal and the window are bands of diagonals: flashgen.attention runs the built-in kernels, arch="sm80" sm80's
    bands = {bench_flex.case_mods(c).mask_mod.digest for c in bench_flex.cases(4096, 4, 16, "cpu",
                                                                             names=("causal", "window"))}
    assert not any(c.mask_mod in bands for c in hopper if c.family == "sm90" and not c.score_mod)
    assert {c.mask_mod for c in hopper if c.family == "sm80"} >= bands


def test_time_sm90_modifiers_builds_every_schedule_it_times(monkeypatch):
    """--compile builds, per case, the forward at each block_n in order and overlapped, each persistent or not, each
    backward schedule, and the sm80 backward it falls back to (not with --forward-only); the rule's tables are
    restored after each forced one, and a forced schedule empties flashgen.attention's routes (a route kept from an
    earlier call would run the rule's kernel)."""
    pytest.importorskip("torch")
    import time_sm90_modifiers
    from flashgen.config import BwdConfig
    from flashgen.kernels import serving

    monkeypatch.setattr(serving, "_builds_clean", lambda cfg, spill_slack=0: True)
    tables = serving.SM90_MODIFIER_SCHEDULES, serving.SM90_MODIFIER_BWD_SCHEDULES
    assert list(time_sm90_modifiers.forward_schedules(128)) == [
        f"bn{bn}_{s}" for bn in (128, 64)
        for s in ("in_order", "overlap", "in_order_persistent", "overlap_persistent", "in_order_pingpong")]
    cfgs = time_sm90_modifiers.kernel_configs(128, "bf16", ("alibi",))
    assert (serving.SM90_MODIFIER_SCHEDULES, serving.SM90_MODIFIER_BWD_SCHEDULES) == tables
    forward = {(c.block_n, c.overlap, c.persistent, c.pingpong) for c in cfgs if not isinstance(c, BwdConfig)}
    assert forward == ({(bn, o, p, o) for bn in (128, 64) for o in (False, True) for p in (False, True)}
                       | {(bn, False, False, True) for bn in (128, 64)})
    only = time_sm90_modifiers.kernel_configs(128, "bf16", ("relative_bias",), (4096, 16384), backward=False)
    assert not any(isinstance(c, BwdConfig) for c in only)
    assert len({c.score_mod for c in only}) == 2  # the table's length is the sequence's: a kernel per N
    from flashgen import api
    api._mod_routes["kept"] = api._decode_routes["kept"] = None  # flashgen.reload() forgets the kept plans
    with time_sm90_modifiers.Forced(128, fwd=(64, serving.SM90_IN_ORDER)):
        assert not api._mod_routes and not api._decode_routes
        api._mod_routes["kept"] = None
    assert not api._mod_routes
    backward = {(c.block_m, c.block_n, c.num_warps, c.num_stages, c.stagger)
                for c in cfgs if isinstance(c, BwdConfig) and c.family == "sm90"}
    assert backward == set(serving.SM90_MODIFIER_BWD_SCHEDULES[128])
    assert any(isinstance(c, BwdConfig) and c.family == "sm80" for c in cfgs)
    serving._sm90_modifier_config.cache_clear()


def test_host_cost_times_a_modifier_call_stage_by_stage(tmp_path):
    """host_cost.py --modifier (its own process: it stubs the driver and torch's device property) runs the whole
    modifier call path, with and without autograd, and splits it into the stages it wraps: repeated calls run by
    their plan, without the checks, traces of the full path, or its launcher."""
    import os
    import shutil
    import subprocess

    pytest.importorskip("torch")
    if shutil.which("nvcc") is None or (shutil.which("cc") or shutil.which("gcc")) is None:
        pytest.skip("needs nvcc (the schedule rule's ptxas check) and a C compiler (the driver stub)")
    script = Path(__file__).resolve().parent.parent / "scripts" / "host_cost.py"
    run = subprocess.run([sys.executable, str(script), "--modifier", "prefix_lm", "--calls", "20", "--stages"],
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "FLASHGEN_CACHE_DIR": str(tmp_path)})
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if "us/call" in line]
    assert [line.split(":")[0] for line in lines] == ["plain", "prefix_lm", "prefix_lm (autograd)"]
    assert all("run_mod_plan" in line and "fire_sm90" in line for line in lines[1:])
    assert not any(stage in line for line in lines[1:] for stage in ("check_dense", "launch_prefill", "modifier_kernel"))


def test_schedule_balance_bounds_what_a_dynamic_scheduler_could_gain():
    """The static snake is within a few percent of the ideal at the bench's causal N = 1k (and a greedy hand-out of
    the same order closer), and both are exact on a problem whose tiles all cost the same."""
    import schedule_balance

    ideal, static, dynamic = schedule_balance.makespans(1024, 128, 128, 132, 0.0)
    assert ideal <= dynamic <= static <= 1.05 * ideal and dynamic < static
    ideal, static, dynamic = schedule_balance.makespans(128, 128, 128, 16, 0.0, batch_tokens=128, heads_dim_total=2048)
    assert ideal == static == dynamic == 1.0  # 16 one-block tiles of cost 1 on 16 CTAs


def test_profile_grid_reads_ncu_raw_page():
    """profile_grid: durations to us from the units row, stall reasons largest first ('selected' left out), and a
    grid label's FLOPs (the bench's batch*seqlen 16384, heads*head_dim 2048, causal halved)."""
    import profile_grid

    pre, post = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"
    text = (f'"Kernel Name","gpu__time_duration.sum","{pre}wait{post}","{pre}selected{post}","{pre}barrier{post}",'
            f'"{pre}long_scoreboard{post}"\n"","ms","inst","inst","inst","inst"\n'
            '"fwd_a(int)","0.301280","1.75","1.0","0.63","0.80"\n')
    row, = profile_grid.raw_rows(text)
    assert abs(float(row["us"]) - 301.28) < 1e-6
    assert profile_grid.stalls(row, top=2) == "wait 1.75 long_scoreboard 0.80"
    assert profile_grid.flops("bf16 d128 N4096 causal") == 4 * 4 * 16 * 4096 * 4096 * 128 / 2


def test_deterministic_timing_compares_the_same_tiles_with_and_without_the_order():
    import time_deterministic_bwd

    c = time_deterministic_bwd.contenders(128, "bf16", True, "sm90")
    assert list(c) == ["default", "dq_tma", "det sm90", "det sm80"]
    assert c["det sm90"].deterministic and c["det sm90"].family == "sm90" and c["det sm80"].family == "sm80"
    assert c["dq_tma"] == dataclasses.replace(c["det sm90"], deterministic=False) and c["dq_tma"].dq_tma


def test_ab_api_alternates_checkouts_and_says_whether_their_outputs_agree(monkeypatch, capsys, tmp_path):
    """ab_api.py --flex: each round runs every checkout's worker (the order turning), keeps each point's best round,
    and marks a point whose checkouts' outputs differ; the workers' figures here are canned."""
    import json
    import os
    import subprocess

    import ab_api

    base, new = tmp_path / "base", tmp_path / "new"
    base.mkdir(), new.mkdir()
    runs = []

    def fake_run(cmd, **kw):
        path = Path(cmd[cmd.index("--worker") + 1])
        runs.append(path.name)
        assert cmd[cmd.index("--flex") + 1] == "alibi,document" and cmd[cmd.index("--pass") + 1] == "bwd"
        assert kw["env"]["PYTHONPATH"].split(os.pathsep)[0] == str(path.resolve()) and kw["cwd"] == str(path)
        tf = {"base": 100.0, "new": 110.0}[path.name] + len(runs)
        out = {"alibi N4096 bwd": [tf, 5.0], "document N4096 bwd": [tf, 7.0 if path.name == "base" else 7.5]}
        return subprocess.CompletedProcess(cmd, 0, json.dumps(out) + "\n", "")

    monkeypatch.setattr(ab_api.subprocess, "run", fake_run)
    monkeypatch.setattr(sys, "argv", ["ab_api.py", f"base={base}", f"new={new}", "--flex", "alibi,document",
                                      "--seqlen", "4096", "--pass", "bwd", "--rounds", "2"])
    ab_api.main()
    assert runs == ["base", "new", "new", "base"]
    table = capsys.readouterr().out.split("best of 2 rounds")[1]
    alibi = next(line for line in table.splitlines() if line.startswith("alibi"))
    assert "104.0" in alibi and "113.0 (1.087)" in alibi and "outputs agree" in alibi
    assert "OUTPUTS DIFFER" in next(line for line in table.splitlines() if line.startswith("document"))


def test_search_vs_exhaustive_runs_both_searches_into_their_own_stores(tmp_path):
    """Each search of a problem gets a storage and tuned directory of its own and stores one entry for the problem
    (the simulated backend: no GPU); a rerun resumes the recorded study and measures nothing again."""
    import search_vs_exhaustive as sve

    spec = ["--arch", "sm90", "--head-dim", "128", "--causal", "no", "--seqlen", "4096", "--pass", "bwd", "--simulate"]
    exhaustive = sve.search(spec, ["--exhaustive"], tmp_path / "e")
    halving = sve.search(spec, ["--search", "halving"], tmp_path / "h")
    assert exhaustive["problem"] == halving["problem"] and exhaustive["problem"]["pass_"] == "bwd"
    fitting = [c for c in bwd_space(128, "bf16", False, family="sm90") if c.unfit_reason("sm90") is None]
    assert exhaustive["trials"] == halving["trials"] == len(fitting)  # every fitting configuration of the space
    assert (tmp_path / "e" / "study.db").exists() and (tmp_path / "h" / "study.db").exists()
    assert sve.search(spec, ["--exhaustive"], tmp_path / "e")["kernel"] == exhaustive["kernel"]


def test_time_configs_times_in_rounds_and_compares_each_problem_with_its_base():
    """Rounds take every point in turn (a drift of the card falls on all alike); the table gives each point's rounds,
    their median and its ratio to the first point of its own problem, not to another problem's."""
    base = KernelConfig(128, "bf16", False, 128, 128, 12, 2, "sm90")
    on = dataclasses.replace(base, desc_step=True)
    d64 = KernelConfig(64, "bf16", False, 128, 128, 12, 2, "sm90")
    shape = (4, 4096, 4096, 16, None)
    pts = [time_configs.Point(n, c, "N=4096", shape, None, None, 1e-3)
           for n, c in (("a", base), ("b", on), ("c", d64), ("d", dataclasses.replace(d64, desc_step=True)))]
    order, ms = [], {"a": [1.0, 1.2, 1.1], "b": [0.9, 0.95, 1.0], "c": [2.0, 2.0, 2.0], "d": [2.2, 2.2, 2.2]}

    def timer(pt, reps):
        order.append(pt.name)
        return ms[pt.name][order.count(pt.name) - 1]

    times = time_configs.timed_rounds(pts, 3, 5, timer)
    assert order == ["a", "b", "c", "d"] * 3 and times == [ms[k] for k in "abcd"]
    lines = time_configs.table(pts, times)
    assert lines[0].startswith("a (fwd_sm90_d128_bf16_full_bm128_bn128_w12_s2_ov0_pp0) N=4096: 1.100 ms") and "x1.000 the base's time (rounds 1.000 1.200 1.100" in lines[0]
    assert "x0.864 the base's time" in lines[1]  # 0.95 / 1.10
    assert "x1.000" in lines[2] and "x1.100 the base's time" in lines[3]  # d64 against d64's base, not d128's


def test_fill_kernel_cache_around_store_takes_stored_backwards_too():
    """--around-store FIELD compiles what tune --around-store evaluates, with --pass bwd too: each stored dense
    backward with only FIELD free (here the two values of lse_ahead in the space)."""
    import fill_kernel_cache

    got = fill_kernel_cache.around_store_configs("sm90", ["lse_ahead"], problems=["sm90_d128_bf16_full_s4096"])
    bwd = {c for c in got if isinstance(c, BwdConfig)}
    assert {c.lse_ahead for c in bwd} == {0, 2} and len(bwd) == 2 and all(c.head_dim == 128 for c in bwd)
    assert len({dataclasses.replace(c, lse_ahead=0) for c in bwd}) == 1  # the stored tile, nothing else free
    assert all(not c.desc_step for c in got if isinstance(c, KernelConfig))  # the forward with lse_ahead: itself


def test_gpu_suites_narrowed_by_name_keep_their_defaults(monkeypatch):
    """FLASHGEN_TEST_NAMES narrows the GPU suites (and fill_kernel_cache's view of them) to the kernels whose names
    hold one of its pieces, beside each suite's defaults."""
    import fill_kernel_cache

    every = {s: fill_kernel_cache.test_suite_configs("sm90", (s,)) for s in ("fwd", "bwd")}
    monkeypatch.setenv("FLASHGEN_TEST_NAMES", "_dst,_la")
    some = {s: fill_kernel_cache.test_suite_configs("sm90", (s,)) for s in ("fwd", "bwd")}
    for s in some:
        assert some[s] < every[s]
        assert {c for c in every[s] if "_dst" in c.name or "_la" in c.name} <= some[s]
    assert any(not c.desc_step for c in some["fwd"] if isinstance(c, KernelConfig))  # the defaults stay
    assert sum(isinstance(c, BwdConfig) and c.lse_ahead > 0 for c in some["bwd"]) > 0


def test_search_vs_exhaustive_times_a_winner_on_its_problem(monkeypatch):
    """A stored winner becomes a time_configs point on its own problem's shape (batch and heads from the entry's
    token and head-dim totals, KV heads by its GQA group), with the backward's forward beside a backward."""
    import search_vs_exhaustive as sve

    monkeypatch.setattr(time_configs, "compiled", lambda cfg, arch: ("kernel", "fwd" if isinstance(cfg, BwdConfig) else None))
    store = read_store(Path(__file__).resolve().parent.parent / "tuned" / "nvidia-h200-sm90.json")["entries"]
    bwd = sve.point("halving", store["sm90_d128_bf16_full_s4096_g1_bt16384_hdt2048_bwd"])
    assert bwd.shape == (4, 4096, 4096, 16, 16) and bwd.fwd == "fwd" and bwd.where == "N=4096"
    gqa = sve.point("exhaustive", store["sm90_d128_bf16_causal_s4096_g4_bt16384_hdt4096_bwd"])
    assert gqa.shape == (4, 4096, 4096, 32, 8) and gqa.name == "exhaustive"


def test_fill_kernel_cache_store_takes_only_the_named_problems():
    import fill_kernel_cache

    some = fill_kernel_cache.store_configs("sm90", ["sm90_d128_bf16_full_s4096"])
    everything = fill_kernel_cache.store_configs("sm90")
    assert some and some < everything and all(c.head_dim == 128 and not c.causal for c in some)
