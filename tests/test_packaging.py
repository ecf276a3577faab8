"""An installed flashgen finds its templates and tuned store without the repo around it."""
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_wheel_carries_templates_and_tuned(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), "."],
                   check=True, capture_output=True)
    wheel = next(tmp_path.glob("flashgen-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for part in ("flashgen/templates/sm80/fwd.cu.j2", "flashgen/templates/common/params.cuh.j2",
                 "flashgen/templates/sm80/ptx.cuh.j2", "flashgen/templates/sm90/fwd.cu.j2",
                 "flashgen/templates/sm90/params.cuh.j2", "flashgen/templates/sm90/fwd/mainloop.cuh.j2",
                 "flashgen/templates/sm90/bwd/mainloop.cuh.j2", "flashgen/tuned/nvidia-h200-sm90.json",
                 "flashgen/data/peers.json", "flashgen/__init__.py"):
        assert part in names, f"{part} missing from {wheel.name}"
    # Installed elsewhere, the package renders from its own copy of the templates.
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import flashgen, flashgen.paths as p; from flashgen.config import default_config;"
            "assert str(p.templates_dir()).startswith(%r), p.templates_dir();"
            "print(flashgen.render(default_config(64, 'bf16', True))[:60])" % str(site))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "fwd_sm80_d64_bf16_causal" in out.stdout


def test_import_flashgen_gives_its_fp8_helpers_without_importing_torch():
    """`import flashgen; flashgen.fp8.quantize(...)`, as the README writes it; torch stays an optional import."""
    code = ("import sys, flashgen; assert callable(flashgen.fp8.quantize) and callable(flashgen.fp8.emulate); "
            "assert 'torch' not in sys.modules, 'import flashgen imported torch'")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
