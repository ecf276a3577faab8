"""Tuning a problem with a score_mod / mask_mod on the CPU: `flashgen tune --score-mod/--mask-mod` parsed and checked,
problem keys and study names carrying the digests, the space generated with the modifiers, a simulated tune's store
entry found for the same modifiers and not for others, the modifiers sent to other processes as data, and the
worker's float64 reference applying them."""
from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from flashgen import cli, search, store, tunable  # noqa: E402
from flashgen.cli.tune import add_parser  # noqa: E402
from flashgen.modifiers import trace_mask_mod, trace_score_mod  # noqa: E402
from flashgen.problem import TuneProblem  # noqa: E402
from flashgen.render import render  # noqa: E402
from flashgen.tune_modifier import default_config, reference  # noqa: E402
from flashgen.worker import compile_args, compile_kernel, compile_with  # noqa: E402
from modifier_examples import examples, trace  # noqa: E402
from test_gpu_modifiers import flex_reference  # noqa: E402

GPU = ("Simulated GPU", "sm90")
MODS = textwrap.dedent("""
    import torch

    def softcap(score, b, h, q_idx, kv_idx):
        return 20.0 * torch.tanh(score / 20.0)

    def bias(score, b, h, q_idx, kv_idx):
        return score + 0.01 * (kv_idx - q_idx)

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= 100)

    slopes = torch.ones(16)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
""")


@pytest.fixture
def mods_file(tmp_path):
    path = tmp_path / "mods.py"
    path.write_text(MODS)
    return path


def tune_args(tmp_path, *extra: str) -> list[str]:
    return ["tune", "--head-dim", "64", "--causal", "no", "--seqlen", "1024", "--trials", "3", "--simulate",
            "--storage", f"sqlite:///{tmp_path / 's.db'}", "--tuned-dir", str(tmp_path / "tuned"), *extra]


def test_the_cli_parses_the_modifier_flags(mods_file):
    import argparse

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["tune", "--score-mod", f"{mods_file}:softcap", "--mask-mod", f"{mods_file}:window"])
    assert (args.score_mod, args.mask_mod) == (f"{mods_file}:softcap", f"{mods_file}:window")
    args = parser.parse_args(["tune"])
    assert args.score_mod is None and args.mask_mod is None


@pytest.mark.parametrize("extra, message", [
    (["--score-mod", "{f}:nothing"], "has no function nothing"),
    (["--score-mod", "{f}"], "expected FILE.py:FUNCTION"),
    (["--mask-mod", "{f}:nowhere"], "has no function nowhere"),
    (["--score-mod", "{f}:softcap", "--kind", "varlen"], "--kind varlen takes no modifier"),
])
def test_bad_modifier_arguments_are_one_line_errors(tmp_path, mods_file, capsys, extra, message):
    assert cli.main(tune_args(tmp_path, *[e.format(f=mods_file) for e in extra])) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_sm80_modifier_tuning_on_hopper_says_what_the_calls_run(tmp_path, mods_file, capsys, monkeypatch):
    """On an sm90 GPU, --arch sm80 with a modifier tunes kernels that attention() takes only with arch="sm80": one
    line on stderr says so and names --arch sm90; --arch sm90 says nothing."""
    import argparse

    from flashgen.cli import tune as tune_cli

    monkeypatch.setattr(tune_cli, "current_gpu", lambda: ("NVIDIA H200", "sm90"))
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    for arch, warned in (("sm80", True), ("sm90", False)):
        args = parser.parse_args(["tune", "--arch", arch, "--score-mod", f"{mods_file}:softcap"])
        assert tune_cli.tune_modifiers(args)["score_mod"]
        err = capsys.readouterr().err
        assert ("--arch sm90 tunes what it runs" in err and "NVIDIA H200" in err) == warned, err


def test_keys_and_study_names_carry_the_digests():
    s = trace_score_mod(lambda score, b, h, q_idx, kv_idx: score * 0.5)
    m = trace_mask_mod(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    plain = TuneProblem(*GPU, "sm80", "bf16", 64, False, 1024)
    p = TuneProblem(*GPU, "sm80", "bf16", 64, False, 1024, score_mod=s.digest, mask_mod=m.digest)
    assert p.key == f"{plain.key}_sm{s.digest}_mm{m.digest}"
    assert p.study_name.endswith(p.key) and search.study_name(p, search.problem_space(p)).startswith(p.study_name)
    assert tunable.kind_of(p) is tunable.MODIFIER and tunable.kind_of(plain) is tunable.DENSE
    assert tunable.problem_from_dict(p.to_dict()) == p
    space = search.problem_space(p)
    assert space and all((c.score_mod, c.mask_mod, c.block_map) == (s.digest, m.digest, True) and not c.features
                         for c in space)
    for cfg in space:  # the search's parameters give back the modifier configuration
        assert search.config_of(p, search.params_of(cfg)) == cfg
    d = default_config(p)
    assert (d.score_mod, d.mask_mod, d.block_map) == (s.digest, m.digest, True)
    only_score = TuneProblem(*GPU, "sm80", "bf16", 64, False, 1024, score_mod=s.digest)
    assert not any(c.block_map for c in search.problem_space(only_score))


def test_a_simulated_tune_stores_an_entry_only_its_modifiers_find(tmp_path, mods_file, capsys):
    mods = ["--score-mod", f"{mods_file}:softcap", "--mask-mod", f"{mods_file}:window"]
    assert cli.main(tune_args(tmp_path, *mods)) == 0
    capsys.readouterr()
    ns: dict = {}
    exec(MODS, ns)  # the same functions, traced here as a call traces them
    softcap, window, bias = (trace_score_mod(ns["softcap"]), trace_mask_mod(ns["window"]),
                             trace_score_mod(ns["bias"]))
    entries = json.loads((tmp_path / "tuned" / "simulated-gpu-sm90.json").read_text())["entries"]
    (key, entry), = entries.items()
    assert key.endswith(f"_sm{softcap.digest}_mm{window.digest}")
    assert entry["config"]["score_mod"] == softcap.digest and entry["config"]["block_map"]
    find = lambda s, m: store.lookup(*GPU, 64, "bf16", False, 1024, "sm80", tuned_dir=tmp_path / "tuned",  # noqa: E731
                                     score_mod=s, mask_mod=m)
    got = find(softcap.digest, window.digest)
    assert got is not None and got.name == entry["kernel"]
    assert find(bias.digest, window.digest) is None  # another score_mod
    assert find(softcap.digest, "") is None  # the same score_mod without the mask
    assert find("", "") is None  # a plain call never takes a modifier entry
    # a plain tune of the same problem is another entry, which the modifier call does not take either
    assert cli.main(tune_args(tmp_path)) == 0
    assert len(json.loads((tmp_path / "tuned" / "simulated-gpu-sm90.json").read_text())["entries"]) == 2
    assert find(softcap.digest, window.digest).name == entry["kernel"]
    assert find("", "").score_mod == ""


def test_a_simulated_sm90_tune_of_a_modifier_reading_tensors(tmp_path, mods_file, capsys, monkeypatch):
    """--arch sm90 tunes the family Hopper's calls run, over its modifier space; a modifier that reads a tensor is
    tuned too, its file named in each task (the worker runs it for the tensor); the entry answers the sm90 lookup
    with exactly these modifiers, and ops.modifier_kernel takes it over the rule."""
    from flashgen import ops, resolve, tune_modifier
    from flashgen.checks import Mods

    log = tmp_path / "evals.log"
    mods = ["--score-mod", f"{mods_file}:alibi", "--mask-mod", f"{mods_file}:window", "--arch", "sm90",
            "--simulate-log", str(log)]
    assert cli.main(tune_args(tmp_path, *mods)) == 0
    out = capsys.readouterr().out
    ns: dict = {}
    exec(MODS, ns)
    alibi, window = trace_score_mod(ns["alibi"]), trace_mask_mod(ns["window"])
    (key, entry), = json.loads((tmp_path / "tuned" / "simulated-gpu-sm90.json").read_text())["entries"].items()
    assert key.startswith("sm90_") and key.endswith(f"_sm{alibi.digest}_mm{window.digest}") and key in out
    cfg = tunable.candidate_of_entry(entry)
    assert cfg.family == "sm90" and (cfg.score_mod, cfg.mask_mod, cfg.block_map) == (alibi.digest, window.digest, True)
    assert tune_modifier.sources(TuneProblem(*GPU, "sm90", "bf16", 64, False, 1024, score_mod=alibi.digest,
                                             mask_mod=window.digest)) == {alibi.digest: ("score", f"{mods_file.resolve()}:alibi")}
    p = TuneProblem(*GPU, "sm90", "bf16", 64, False, 1024, score_mod=alibi.digest, mask_mod=window.digest)
    space = search.problem_space(p)
    assert 16 <= len(space) <= 64 and all(c.block_m == 128 and c.block_n in (64, 128) and not (c.o_tma or c.cluster)
                                          for c in space)
    assert {(c.overlap, c.persistent) for c in space} == {(a, b) for a in (False, True) for b in (False, True)}
    assert default_config(p).family == "sm90"
    look = lambda s, m: store.lookup(*GPU, 64, "bf16", False, 1024, "sm90", tuned_dir=tmp_path / "tuned",  # noqa: E731
                                     score_mod=s, mask_mod=m)
    assert look(alibi.digest, window.digest) == cfg and look(alibi.digest, "") is None and look("", "") is None
    monkeypatch.setenv("FLASHGEN_TUNED_DIR", str(tmp_path / "tuned"))
    monkeypatch.setattr(resolve, "gpu", lambda device: GPU)
    monkeypatch.setattr(ops, "arch_and_slots", lambda device: ("sm90", 132))
    resolve.clear()
    try:
        got = ops.modifier_kernel(0, 64, "bf16", False, 1024, 1, Mods(score_mod=alibi, mask_mod=window))
        assert got == cfg
        rule = ops.modifier_kernel(0, 64, "bf16", False, 1024, 1, Mods(score_mod=alibi, mask_mod=window,
                                                                      window=(32, 0)))
        assert rule.window and rule != cfg  # with a window: the rule's kernel, not the tuned one
    finally:
        resolve.clear()


@pytest.mark.parametrize("family, head_dim", [("sm90", 64), ("sm90", 128), ("sm80", 128)])
def test_the_backward_space_with_modifiers(family, head_dim):
    """--pass bwd: the family's whole backward space generated with the modifiers (a mask_mod with its block map),
    never deterministic or with features; the default is the call's rule."""
    s = trace_score_mod(lambda score, b, h, q_idx, kv_idx: score * 0.5)
    m = trace_mask_mod(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    for score, mask in ((s.digest, m.digest), (s.digest, "")):
        p = TuneProblem(*GPU, family, "bf16", head_dim, False, 1024, pass_="bwd", score_mod=score, mask_mod=mask)
        space = search.problem_space(p)
        assert space and all(type(c).__name__ == "BwdConfig" and c.family == family for c in space)
        assert all((c.score_mod, c.mask_mod, c.block_map) == (score, mask, bool(mask)) for c in space)
        assert not any(c.deterministic or c.features for c in space)
        for cfg in space:
            assert search.config_of(p, search.params_of(cfg)) == cfg
        d = default_config(p)
        assert type(d).__name__ == "BwdConfig" and (d.score_mod, d.mask_mod) == (score, mask) and d.family == family


def test_a_simulated_backward_tune_is_taken_by_the_modifier_backward(tmp_path, mods_file, capsys, monkeypatch):
    """tune --pass bwd --arch sm90 with a tensor-reading score_mod and a mask: the entry (key ending _bwd_sm.._mm..)
    answers resolve.modifier_backward_kernel for exactly those modifiers, not a deterministic call nor one with a
    window."""
    from flashgen import resolve

    mods = ["--score-mod", f"{mods_file}:alibi", "--mask-mod", f"{mods_file}:window", "--arch", "sm90", "--pass", "bwd"]
    assert cli.main(tune_args(tmp_path, *mods)) == 0
    capsys.readouterr()
    ns: dict = {}
    exec(MODS, ns)
    alibi, window = trace_score_mod(ns["alibi"]), trace_mask_mod(ns["window"])
    (key, entry), = json.loads((tmp_path / "tuned" / "simulated-gpu-sm90.json").read_text())["entries"].items()
    assert key.startswith("sm90_") and key.endswith(f"_bwd_sm{alibi.digest}_mm{window.digest}")
    cfg = tunable.candidate_of_entry(entry)
    assert type(cfg).__name__ == "BwdConfig" and cfg.family == "sm90" and cfg.block_map
    plain = store.lookup(*GPU, 64, "bf16", False, 1024, "sm90", tuned_dir=tmp_path / "tuned", pass_="bwd")
    assert plain is None  # a plain backward never takes a modifier entry
    monkeypatch.setenv("FLASHGEN_TUNED_DIR", str(tmp_path / "tuned"))
    monkeypatch.setattr(resolve, "gpu", lambda device: GPU)
    monkeypatch.setattr(resolve, "_load_backward", lambda d, dt, c, config, arch, det=False: config)
    resolve.clear()
    try:
        args = (0, 64, "bf16", False)
        assert resolve.modifier_backward_kernel(*args, (), False, alibi.digest, window.digest, True,
                                                seqlen=1000) == cfg
        rule = resolve.modifier_backward_kernel(*args, ("window",), False, alibi.digest, window.digest, True,
                                                seqlen=1000)
        assert rule != cfg and rule.window
        assert resolve.modifier_backward_kernel(*args, (), True, alibi.digest, window.digest, True,
                                                seqlen=1000).deterministic
        assert resolve.modifier_backward_kernel(*args, (), False, alibi.digest, "", False, seqlen=1000) != cfg
    finally:
        resolve.clear()


def test_the_worker_loads_a_modifiers_file_for_its_tensors(tmp_path, mods_file):
    """load_sources runs the file again (as a worker process does) and keeps the trace with its tensors; a file
    that now traces to another digest is refused, naming the file."""
    from flashgen import tune_modifier
    from flashgen.cli.common import load_modifier

    alibi = load_modifier(f"{mods_file}:alibi", "score")
    tune_modifier._LOADED.clear()
    tune_modifier.load_sources({alibi.digest: ("score", f"{mods_file}:alibi")})
    p = TuneProblem(*GPU, "sm90", "bf16", 64, False, 1024, score_mod=alibi.digest)
    loaded, none = tune_modifier.modifiers_of(p)
    assert none is None and loaded.digest == alibi.digest and len(loaded.tensors) == 1
    assert torch.equal(loaded.tensors[0], torch.ones(16))
    changed = tmp_path / "changed.py"
    changed.write_text(MODS.replace("torch.ones(16)", "torch.ones(8)"))
    with pytest.raises(Exception, match="changed.py:alibi: traces to .* not the modifier 0123456789abcdef"):
        tune_modifier.load_sources({"0123456789abcdef": ("score", f"{changed}:alibi")})
    tune_modifier._LOADED.clear()


def test_the_modifiers_travel_as_data(tmp_path):
    """The compile pool's and the GPU worker's processes get the registered Modifiers (text and graph, no tensors, no
    callables) and render the same kernel and evaluate the same graph after registering them."""
    s = trace_score_mod(lambda score, b, h, q_idx, kv_idx: torch.tanh(score / 7.0) * 7.0 + 0.5 * (q_idx > kv_idx))
    m = trace_mask_mod(lambda b, h, q_idx, kv_idx: (q_idx - kv_idx) % 3 != 1)
    p = TuneProblem(*GPU, "sm80", "bf16", 64, True, 1024, score_mod=s.digest, mask_mod=m.digest)
    sent, files = tunable.kind_of(p).task_args(p)
    assert files == {}
    assert [x.digest for x in sent] == [s.digest, m.digest] and all(x.tensors == () for x in sent)
    cfg = default_config(p)
    task = compile_args(cfg, "sm_80")
    assert task[0] is compile_with and task[1:3] == (cfg, "sm_80") and task[3] == sent
    plain = TuneProblem(*GPU, "sm80", "bf16", 64, True, 1024).default_config()
    assert compile_args(plain, "sm_80")[0] is compile_kernel
    (tmp_path / "mods.pkl").write_bytes(pickle.dumps((cfg, sent)))
    code = textwrap.dedent(f"""
        import pickle, torch
        from flashgen.modifiers import lookup, register
        from flashgen.render import render
        cfg, mods = pickle.loads(open({str(tmp_path / 'mods.pkl')!r}, 'rb').read())
        for x in mods:
            register(x)
        i = torch.arange(5)
        print(hash(render(cfg)) == hash(render(cfg)), render(cfg).count("tanhf"))
        print(lookup(cfg.mask_mod, "mask").evaluate(0, 0, i[:, None], i[None, :]).int().tolist())
        open({str(tmp_path / 'src.cu')!r}, 'w').write(render(cfg))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    i = torch.arange(5)
    assert out.stdout.splitlines()[1] == str(m.evaluate(0, 0, i[:, None], i[None, :]).int().tolist())
    assert (tmp_path / "src.cu").read_text() == render(cfg)


@pytest.mark.parametrize("name", ["alibi_causal", "softcap_document", "relative_prefix_lm", "sliding_window"])
@pytest.mark.parametrize("causal", [False, True])
def test_the_verify_reference_applies_the_modifiers(name, causal):
    """tune_modifier.reference (the modifiers' graphs) equals the float64 reference of the user's own functions, and
    differs from attention without them."""
    ex = examples("cpu", batch=2, heads=4)[name]
    score_mod, mask_mod = trace(ex)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 37, 4, 32, generator=g)
    k, v = (torch.randn(2, 53, 2, 32, generator=g) for _ in range(2))
    scale = 32 ** -0.5
    out, lse = reference(q, k, v, causal, scale, score_mod, mask_mod)
    want, want_lse = flex_reference(q, k, v, scale, ex.score_mod, ex.mask_mod, causal)
    assert out.dtype == torch.float64 and out.shape == q.shape and lse.shape == (2, 4, 37)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)  # the score_mod runs in float32, as in the kernel
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    plain, _ = reference(q, k, v, causal, scale, None, None)
    assert (plain - out).abs().max() > 1e-2


def test_the_gpu_backend_sends_the_modifiers_with_each_task():
    """GpuBackend (its compiler and worker stood in for): a modifier problem's trials and retimes go to
    flashgen.tune_modifier's tasks with the registered modifiers; a problem whose modifiers were never traced here
    is an error value naming the problem, not an exception."""
    from types import SimpleNamespace

    from flashgen.worker import GpuBackend

    s = trace_score_mod(lambda score, b, h, q_idx, kv_idx: score * 0.25)
    calls = []

    class Worker:
        def call(self, task, *args, deadline_s):
            calls.append((task, args))
            if task.endswith("gpu_retime"):
                return "ok", [1.0] * len(args[1])
            return "ok", {"status": "ok", "ms": 1.0, "max_err": 0.0, "reason": "", "kernel": args[1].name}

    class Compiled:
        def get(self, cfg, target):
            return SimpleNamespace(resources=SimpleNamespace(registers=64, spill_stores=0, spill_loads=0,
                                                             smem_bytes=0, spills=False), ptxas_log="")

    b = object.__new__(GpuBackend)
    b.worker, b.gpu_arch, b.compiler, b.deadline_s, b.warmup, b.reps = Worker(), "sm80", Compiled(), 30, 1, 1
    p = TuneProblem("G", "sm80", "sm80", "bf16", 64, False, 1024, score_mod=s.digest)
    cfg = default_config(p)
    assert b.evaluate(cfg, p).ok
    assert b.retime([cfg], p, 2) == [1.0]
    (trial, targs), (retime, rargs) = calls
    assert trial == "flashgen.tune_modifier:gpu_trial" and retime == "flashgen.tune_modifier:gpu_retime"
    assert [m.digest for m in targs[-2]] == [s.digest] and rargs[-2:] == targs[-2:]
    assert targs[-1] == {}  # a modifier reading no tensor names no file
    unknown = TuneProblem("G", "sm80", "sm80", "bf16", 64, False, 1024, score_mod="0123456789ab")
    res = b.evaluate(cfg, unknown)
    assert res.status == "error" and unknown.key in res.reason and "not traced" in res.reason
    assert b.retime([cfg], unknown, 2) == [None] and len(calls) == 2


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_compile_only_builds_the_modifier_space_in_the_compile_pool(tmp_path, mods_file, capsys, monkeypatch):
    """The compile pool's spawned processes never traced the modifiers: they get them with each task."""
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "cache"))
    assert cli.main(["tune", "--compile-only", "--gpu-arch", "sm80", "--head-dim", "64", "--causal", "no",
                     "--score-mod", f"{mods_file}:softcap", "--mask-mod", f"{mods_file}:window", "--max-configs", "1",
                     "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "_bmap" in out and "1 of 1 configurations pass" in out
