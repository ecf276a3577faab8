"""The `flashgen` command (flashgen.cli): help, errors as one clear line, --compile-only on a small space, a simulated
tune/show/export, and the command as a checkout, `python -m flashgen` and an installed console script run it."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from flashgen import cli, worker
from flashgen.cli import common

REPO = Path(__file__).resolve().parent.parent


def run(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m flashgen ARGS` from the checkout (whose flashgen it imports)."""
    return subprocess.run([sys.executable, "-m", "flashgen", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


@pytest.mark.parametrize("cmd", [[], ["tune"], ["show"], ["export"], ["check"], ["dashboard"]])
def test_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([*cmd, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage: flashgen" in out
    if cmd == ["tune"]:
        for flag in ("--arch", "--head-dim", "--dtype", "--causal", "--seqlen", "--batch-tokens", "--heads-dim-total",
                     "--trials", "--timeout", "--storage", "--compile-only", "--force", "--exhaustive", "--sampler",
                     "--compile-timeout", "--gpus", "--collect", "--heartbeat", "--grace"):
            assert flag in out
        assert "--simulate-delay" not in out  # test-only options stay hidden
    if cmd == ["show"]:
        assert "--from-storage" in out
    if cmd == ["export"]:
        assert "--features" in out and "--rows" in out and "--gpu-arch" in out
    if cmd == []:
        assert "dashboard" in out


@pytest.mark.parametrize("args, words", [
    (["tune", "--head-dim", "65", "--compile-only"], "--head-dim 65: choose from"),
    (["tune", "--arch", "sm75", "--compile-only"], "--arch sm75: choose from sm80"),
    (["tune", "--dtype", "fp32", "--compile-only"], "--dtype fp32"),
    (["tune", "--head-dim", "96", "--gqa", "5", "--compile-only"], "not a multiple"),
    (["tune", "--block-m", "48", "--compile-only"], "--block-m 48"),
    (["tune", "--trials", "0"], "--trials must be at least 1"),
    (["check", "--head-dim", "7"], "--head-dim 7"),
    (["tune", "--block-m", "192", "--compile-only"], "--block-m 192: choose from 64,128,256"),  # sm80's choices
    (["tune", "--block-m", "64", "--num-warps", "16", "--compile-only"], "space of family sm80 is empty"),
    (["tune", "--gqa", "0", "--compile-only"], "--gqa 0: the group size"),
    (["bench", "--seqlen", "0", "--simulate"], "--seqlen values must be positive"),
    (["bench", "--reps", "0", "--simulate"], "--reps must be at least 1"),
    (["tune", "--simulate", "--heartbeat", "30", "--grace", "20"], "--grace 20 must be longer than --heartbeat 30"),
    (["tune", "--simulate", "--gpus", "all"], "--gpus all needs real GPUs"),
    (["export", "--out", "x", "--features", "varlen,paging"], "--features paging: choose from varlen,paged"),
    (["export", "--out", "x", "--features", "paged"], "paged=True needs varlen=True"),
    (["export", "--out", "x", "--features", "varlen", "--arch", "sm90"], "serving kernels are family sm80"),
    (["export", "--out", "x", "--features", "varlen", "--gpu", "NVIDIA H200"], "drop --gpu and --tuned-dir"),
])
def test_errors_are_one_clear_line(args, words, capsys):
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_bad_flag_values_are_argparse_errors(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["tune", "--timeout", "soon"])
    assert e.value.code == 2 and "duration" in capsys.readouterr().err


def test_gpu_lists():
    assert common.gpu_list("all") == "all" and common.gpu_list("0,1") == [0, 1] and common.gpu_list("0,0") == [0, 0]
    with pytest.raises(Exception, match="GPU indices"):
        common.gpu_list("-1")


def test_durations():
    assert common.duration("90") == 90 and common.duration("10m") == 600 and common.duration("1.5h") == 5400


def test_tune_without_a_gpu_points_at_compile_only(monkeypatch, capsys):
    def no_gpu(*a, **k):
        raise worker.NoGpuError("the GPU worker could not start: no CUDA device")

    monkeypatch.setattr(worker, "GpuBackend", no_gpu)
    assert cli.main(["tune", "--head-dim", "64"]) == 2
    err = capsys.readouterr().err
    assert "no GPU" in err and "--compile-only" in err


def test_bench_flex_takes_a_subset_of_the_cases(monkeypatch, capsys):
    """bench --kind flex --cases: the named examples only, in their order; a name that is none of them is refused
    before any GPU is looked for."""
    from flashgen import bench_flex
    from flashgen.cli import bench

    seen = []
    monkeypatch.setattr(bench, "cuda_torch", lambda *a: SimpleNamespace(
        cuda=SimpleNamespace(get_device_name=lambda: "test"), __version__="0"))
    monkeypatch.setattr(bench_flex, "flex_rows", lambda n, *a, names=(), **k: seen.append((n, names)) or [])
    assert cli.main(["bench", "--kind", "flex", "--seqlen", "4096", "--cases", "document,prefix_lm"]) == 0
    assert seen == [(4096, ("document", "prefix_lm"))]
    assert cli.main(["bench", "--kind", "flex", "--cases", "doc"]) == 2
    assert "--cases doc: choose from" in capsys.readouterr().err and len(seen) == 1


def test_newer_family_on_an_older_gpu_is_refused():
    with pytest.raises(common.CliError, match="need an sm90 or newer GPU; NVIDIA A100 is sm80"):
        common.check_family("sm90", "NVIDIA A100", "sm80")
    common.check_family("sm80", "NVIDIA H200", "sm90")  # older families run on newer GPUs


def test_compile_only_on_a_small_space(tmp_path):
    env = {**__import__("os").environ, "FLASHGEN_CACHE_DIR": str(tmp_path / "cache")}
    t = time.monotonic()
    p = run("tune", "--arch", "sm80", "--head-dim", "64", "--causal", "no", "--compile-only", "--gpu-arch", "sm86",
            "--block-m", "64,256", "--num-warps", "4", "--block-n", "64", "--max-configs", "5", "--jobs", "2", env=env)
    assert p.returncode == 0, p.stderr
    assert time.monotonic() - t < 60
    out = p.stdout
    assert "for sm_86" in out and "regs" in out and "spill" in out
    assert out.count("fwd_sm80_d64_bf16_full_") == 5
    assert "no: 256 accumulator registers" in out  # bm256 with 4 warps: a constraint fails, with its reason
    assert "of 5 configurations pass the constraints of sm86" in out


def test_simulated_tune_show_export_and_rerun(tmp_path, capsys):
    common = ["tune", "--head-dim", "64", "--causal", "no", "--seqlen", "1024,4096", "--trials", "6", "--simulate",
              "--storage", f"sqlite:///{tmp_path / 's.db'}", "--tuned-dir", str(tmp_path / "tuned")]
    assert cli.main(common) == 0
    out = capsys.readouterr().out
    assert "sm80_d64_bf16_full_s1024_g1" in out and "added" in out and "6/" in out
    assert (tmp_path / "tuned" / "simulated-gpu-sm90.json").is_file()
    assert cli.main(common) == 0  # the same command again: the studies are complete, the store kept
    out = capsys.readouterr().out
    assert "kept" in out and "6/" in out
    assert cli.main(["show", "--tuned-dir", str(tmp_path / "tuned")]) == 0
    out = capsys.readouterr().out
    assert "Simulated GPU (sm90)" in out and "sm80_d64_bf16_full_s4096_g1" in out
    assert cli.main(["show", "--tuned-dir", str(tmp_path / "tuned"), "--gpu", "NVIDIA H200"]) == 0
    assert "no tuned results for NVIDIA H200" in capsys.readouterr().out
    assert cli.main(["export", "--out", str(tmp_path / "x"), "--tuned-dir", str(tmp_path / "tuned")]) == 0
    doc = json.loads((tmp_path / "tuned" / "simulated-gpu-sm90.json").read_text())
    kernels = {e["kernel"] for e in doc["entries"].values()}  # the two buckets may share their best kernel
    assert f"wrote {len(kernels)} kernels" in capsys.readouterr().out
    assert {p.stem for p in (tmp_path / "x").glob("*.cu")} == kernels


def test_around_store_retunes_only_the_free_fields_of_the_stored_configuration(tmp_path, capsys):
    common = ["tune", "--arch", "sm90", "--head-dim", "128", "--causal", "no", "--seqlen", "4096", "--overlap", "yes",
              "--simulate", "--tuned-dir", str(tmp_path / "tuned")]
    assert cli.main(common + ["--trials", "4", "--lazy-rescale", "no", "--storage", f"sqlite:///{tmp_path / 'a.db'}"]) == 0
    doc = json.loads((tmp_path / "tuned" / "simulated-gpu-sm90.json").read_text())
    (key, entry), = doc["entries"].items()
    assert not entry["config"]["lazy_rescale"]
    capsys.readouterr()
    assert cli.main(common + ["--around-store", "lazy-rescale", "--force", "--storage", f"sqlite:///{tmp_path / 'b.db'}"]) == 0
    out = capsys.readouterr().out
    assert "exhaustive: all 2 fitting configurations" in out  # the stored tile with the knob off and on
    new = json.loads((tmp_path / "tuned" / "simulated-gpu-sm90.json").read_text())["entries"][key]["config"]
    assert {k: v for k, v in new.items() if k != "lazy_rescale"} == {k: v for k, v in entry["config"].items()
                                                                      if k != "lazy_rescale"}
    assert cli.main(common + ["--around-store", "tile"]) == 2
    assert "--around-store tile" in capsys.readouterr().err
    # the stored tile has overlap on: restricting to overlap off leaves nothing around it, said in one line
    assert cli.main(common[:-5] + ["--overlap", "no", "--simulate", "--tuned-dir", str(tmp_path / "tuned"),
                                   "--around-store", "lazy_rescale", "--storage", f"sqlite:///{tmp_path / 'c.db'}"]) == 2
    err = capsys.readouterr().err
    assert "no configuration of the restricted space matches the stored one" in err and "Traceback" not in err


def test_around_store_retunes_a_stored_backward_over_its_free_fields(tmp_path, capsys):
    """--pass bwd: the stored backward tile with num_stages and stagger free (one to three stages, staggered or
    not, as fit), the rest kept."""
    common = ["tune", "--pass", "bwd", "--arch", "sm90", "--head-dim", "128", "--causal", "no", "--seqlen", "4096",
              "--simulate", "--tuned-dir", str(tmp_path / "tuned")]
    assert cli.main(common + ["--trials", "4", "--storage", f"sqlite:///{tmp_path / 'a.db'}"]) == 0
    (key, entry), = json.loads((tmp_path / "tuned" / "simulated-gpu-sm90.json").read_text())["entries"].items()
    capsys.readouterr()
    assert cli.main(common + ["--around-store", "num_stages,stagger", "--force",
                              "--storage", f"sqlite:///{tmp_path / 'b.db'}"]) == 0
    out = capsys.readouterr().out
    found = re.search(r"exhaustive: all (\d+) fitting configurations", out)
    assert found and 2 <= int(found.group(1)) <= 6, out
    new = json.loads((tmp_path / "tuned" / "simulated-gpu-sm90.json").read_text())["entries"][key]["config"]
    free = ("num_stages", "stagger")
    assert {k: v for k, v in new.items() if k not in free} == {k: v for k, v in entry["config"].items()
                                                                if k not in free}


def test_around_store_of_a_gqa_problem_starts_from_its_mha_entry(tmp_path, capsys):
    """A GQA problem without an entry of its own is re-tuned around the same shape's MHA entry (--gqa 1): its stored
    tile with pack_gqa off and on, stored as the GQA group's entry."""
    common = ["tune", "--arch", "sm90", "--head-dim", "128", "--causal", "no", "--seqlen", "1024", "--simulate",
              "--tuned-dir", str(tmp_path / "tuned")]
    # o_tma and cluster exclude pack_gqa: the MHA entry has neither, so its GQA space is the tile packed and not
    assert cli.main(common + ["--trials", "4", "--o-tma", "no", "--cluster", "no",
                              "--storage", f"sqlite:///{tmp_path / 'a.db'}"]) == 0
    doc = json.loads((tmp_path / "tuned" / "simulated-gpu-sm90.json").read_text())
    (mha_key, mha), = doc["entries"].items()
    capsys.readouterr()
    assert cli.main(common + ["--gqa", "4", "--around-store", "pack_gqa", "--storage", f"sqlite:///{tmp_path / 'b.db'}"]) == 0
    assert "exhaustive: all 2 fitting configurations" in capsys.readouterr().out
    entries = json.loads((tmp_path / "tuned" / "simulated-gpu-sm90.json").read_text())["entries"]
    (gqa_key, gqa), = [(k, e) for k, e in entries.items() if k != mha_key]
    assert "_g4_" in gqa_key and {k: v for k, v in gqa["config"].items() if k != "pack_gqa"} == {
        k: v for k, v in mha["config"].items() if k != "pack_gqa"}


def test_show_names_a_corrupt_store(tmp_path, capsys):
    (tmp_path / "x-sm90.json").write_text("{")
    assert cli.main(["show", "--tuned-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "x-sm90.json" in err and "not valid JSON" in err and "Traceback" not in err


def test_show_and_export_on_an_empty_store(tmp_path, capsys):
    assert cli.main(["show", "--tuned-dir", str(tmp_path)]) == 0
    assert "no tuned results" in capsys.readouterr().out
    assert cli.main(["export", "--out", str(tmp_path / "o"), "--tuned-dir", str(tmp_path)]) == 0
    assert "nothing tuned" in capsys.readouterr().out


def test_a_missing_nvcc_is_one_line(monkeypatch, capsys):
    import flashgen.compile as comp

    comp.nvcc_path.cache_clear()
    comp.nvcc_version.cache_clear()
    monkeypatch.setenv("FLASHGEN_NVCC", "/nonexistent/nvcc")
    try:
        assert cli.main(["tune", "--compile-only", "--gpu-arch", "sm80", "--head-dim", "64", "--causal", "no",
                         "--max-configs", "1"]) == 2
    finally:
        comp.nvcc_path.cache_clear()
        comp.nvcc_version.cache_clear()
    err = capsys.readouterr().err
    assert "FLASHGEN_NVCC=/nonexistent/nvcc is not a file" in err and "Traceback" not in err


def test_export_of_serving_kernels(tmp_path, capsys):
    from flashgen.kernels.serving import SERVE_PARAMS, serve_config

    assert cli.main(["export", "--out", str(tmp_path), "--features", "varlen,paged,split,pack_gqa", "--features",
                     "varlen,window,softcap,alibi", "--head-dim", "128", "--causal", "no"]) == 0
    assert "wrote 2 serving kernels (5 files)" in capsys.readouterr().out
    dec = serve_config(128, "bf16", False, 1, "sm80", varlen=True, paged=True, split=True, pack_gqa=True)
    mods = serve_config(128, "bf16", False, 1024, "sm80", varlen=True, window=True, softcap=True, alibi=True)
    assert dec.block_m == 32 and mods.block_m == 128  # decode tiles for the paged set, prefill tiles otherwise
    assert {p.stem for p in tmp_path.glob("*.cu")} == {dec.name, mods.name}
    h = (tmp_path / f"{dec.name}.h").read_text()
    assert "struct ServeParams" in h and f"PARAMS_BYTES = {SERVE_PARAMS.size};" in h and f"{dec.name}_combine<<<" in h
    man = json.loads((tmp_path / "manifest.json").read_text())
    assert {m["kernel"] for m in man["kernels"]} == {dec.name, mods.name}
    assert cli.main(["export", "--out", str(tmp_path / "r"), "--features", "varlen", "--rows", "8",
                     "--head-dim", "64", "--causal", "yes", "--dtype", "fp16"]) == 0
    assert [p.stem for p in (tmp_path / "r").glob("*.cu")] == [serve_config(64, "fp16", True, 8, "sm80", varlen=True).name]


VERBS = ["tune", "show", "export", "check", "bench", "dashboard"]


def test_python_m_flashgen_and_each_verb_help():
    p = run("--help")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("usage: flashgen") and all(v in p.stdout for v in VERBS)
    for verb in VERBS:
        p = run(verb, "--help")
        assert p.returncode == 0 and p.stdout.startswith(f"usage: flashgen {verb}"), (verb, p.stderr)


def test_the_checkout_script_runs_the_same_command():
    p = subprocess.run([sys.executable, str(REPO / "cli.py"), "show", "--help"], capture_output=True, text=True,
                       timeout=120, cwd=REPO.parent)
    assert p.returncode == 0 and p.stdout.startswith("usage: flashgen show"), p.stderr


def test_messages_name_the_flashgen_command():
    """What flashgen tells a user to run names the installed command, not a script of the checkout."""
    stale = [f"{path.relative_to(REPO)}:{n}" for path in sorted((REPO / "flashgen").rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if "cli.py" in line]
    assert not stale, stale


@pytest.mark.parametrize("kind", ["decode", "varlen"])
def test_a_serving_tune_without_a_gpu_says_it_needs_one(kind, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert cli.main(["tune", "--kind", kind, "--head-dim", "128"]) == 2
    err = capsys.readouterr().err
    assert "tuning needs an NVIDIA GPU" in err and "pycuda" in err, err
    assert "--compile-only" in err and "bench" not in err


@pytest.mark.install
def test_the_installed_console_script(tmp_path):
    """`pip install` of the tree gives a `flashgen` command that runs from anywhere, on the package's own data."""
    tree = tmp_path / "tree"
    shutil.copytree(REPO, tree, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__",
                                                              ".pytest_cache", "exported", "benchmarks"))
    venv = tmp_path / "venv"
    # without pip: the venv runs the system's pip and setuptools (ensurepip's setuptools may lack bdist_wheel)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps",
                          "--no-build-isolation", str(tree)], capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    shutil.rmtree(tree)  # what runs below is the installed copy, not a checkout
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FLASHGEN_TUNED_DIR")}
    env["FLASHGEN_CACHE_DIR"] = str(tmp_path / "cache")

    def flashgen(*args: str) -> str:
        p = subprocess.run([str(venv / "bin" / "flashgen"), *args], capture_output=True, text=True, cwd=work,
                           env=env, timeout=300)
        assert p.returncode == 0, (args, p.stdout, p.stderr)
        return p.stdout

    assert flashgen("--help").startswith("usage: flashgen")
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import flashgen; print(flashgen.__file__)"],
                           capture_output=True, text=True, cwd=work, env=env, check=True).stdout
    assert where.startswith(str(venv)), where
    assert "NVIDIA H200 (sm90)" in flashgen("show")  # the store shipped in the package
    out = flashgen("export", "--arch", "sm90", "--out", "x")
    assert out.startswith("wrote ") and not out.startswith("wrote 0 ")
    assert list((work / "x").glob("*.cu")) and (work / "x" / "manifest.json").is_file()
