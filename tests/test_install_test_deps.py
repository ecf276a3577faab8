"""scripts/install_test_deps.py: a CPU torch on a machine without a GPU, never PyPI's CUDA build."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "install_test_deps.py"
spec = importlib.util.spec_from_file_location("install_test_deps", SCRIPT)
deps = importlib.util.module_from_spec(spec)
spec.loader.exec_module(deps)

OFFERED = ["2.15.0", "2.14.1", "2.13.0+cpu", "2.13.0", "2.12.0+cpu"]  # pip's listing, newest first


def test_without_the_cpu_index_the_newest_cpu_build_of_the_configured_sources_is_taken(monkeypatch):
    monkeypatch.setattr(deps, "reachable", lambda url, timeout_s=10.0: False)
    monkeypatch.setattr(deps, "offered_versions", lambda package, sources: OFFERED if not sources else [])
    assert deps.cpu_torch_requirement() == ("torch==2.13.0+cpu", [])


def test_the_cpu_index_is_searched_beside_the_configured_sources_when_it_answers(monkeypatch):
    monkeypatch.setattr(deps, "reachable", lambda url, timeout_s=10.0: True)
    seen = []
    monkeypatch.setattr(deps, "offered_versions", lambda package, sources: seen.append(sources) or ["2.16.0+cpu", *OFFERED])
    assert deps.cpu_torch_requirement() == ("torch==2.16.0+cpu", ["--extra-index-url", deps.CPU_INDEX])
    assert seen == [["--extra-index-url", deps.CPU_INDEX]]


def test_no_cpu_build_anywhere_stops_instead_of_taking_a_cuda_build(monkeypatch):
    monkeypatch.setattr(deps, "reachable", lambda url, timeout_s=10.0: False)
    monkeypatch.setattr(deps, "offered_versions", lambda package, sources: ["2.15.0", "2.14.1"])
    with pytest.raises(SystemExit, match="no CPU build of torch"):
        deps.cpu_torch_requirement()


def test_an_installed_torch_is_left_alone(monkeypatch):
    monkeypatch.chdir(deps.REPO)  # main() changes to the checkout: back where the test was, afterwards
    calls = []
    monkeypatch.setattr(deps, "pip_install", lambda *args: calls.append(args))
    monkeypatch.setattr(deps.importlib.util, "find_spec", lambda name: object())  # torch is there
    monkeypatch.setattr(deps, "has_nvidia_gpu", lambda: pytest.fail("no torch to choose"))
    assert deps.main() == 0
    assert calls == [("-e", ".[test,fleet]")]

