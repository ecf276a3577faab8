"""A dense modifier call by its plan (flashgen.kernels.modified), without a GPU: the plan hands the driver exactly the
launch the full path packs, in both families, with a score_mod's table and a block map; calls that change what the
plan was made from do not take it."""
from __future__ import annotations

import dataclasses
import struct

import pytest

from flashgen import driver
from flashgen.checks import Mods
from flashgen.config import KernelConfig
from flashgen.kernels import modified, serving

torch = pytest.importorskip("torch")
from modifier_examples import FakeCuda, examples, trace  # noqa: E402

EXAMPLES = examples()


class Captured(FakeCuda):
    """A captured tensor on the device CPU tensors report (-1), as q, k and v here."""

    def get_device(self) -> int:
        return -1


@pytest.fixture
def launches(monkeypatch):
    """Every launch's (grid, threads, parameter bytes, stream), the GPU faked: CPU tensors, tensor maps that hold
    their base pointer, a block map's lists at fixed addresses."""
    seen = []

    class FakeFn:
        def launch(self, grid, threads, params, stream, programmatic=False):
            seen.append((grid, threads, bytes(params), stream))

    monkeypatch.setattr(driver, "use_device", lambda device: 0)
    monkeypatch.setattr(driver, "primary_context_id", lambda device: 1)
    monkeypatch.setattr(driver, "tensor_map", lambda dt, ptr, dims, st, box, sw: struct.pack("=Q", ptr) * 16)
    monkeypatch.setattr(serving, "_functions", lambda cfg, arch, ctx: (FakeFn(), None))
    monkeypatch.setattr(serving, "current_stream", lambda device: 7)
    monkeypatch.setattr(serving, "error_word", lambda device: 0xE000)
    monkeypatch.setattr(serving, "arch_and_slots", lambda device: ("sm90", 132))
    monkeypatch.setattr(modified, "arch_and_slots", lambda device: ("sm90", 132))
    monkeypatch.setattr(serving, "list_slots", lambda lists, device, batch, heads: list(range(0xB00, 0xB0A)))
    return seen


def _mods(name: str, with_map: bool) -> Mods:
    score, mask = trace(EXAMPLES[name])
    if score is not None:
        score = dataclasses.replace(score, tensors=(Captured(0x1000, (1,)),) * len(score.tensors))
    if mask is not None:
        mask = dataclasses.replace(mask, tensors=(Captured(0x2000, (1,)),) * len(mask.tensors))
    block_map = type("Map", (), {"block": (128, 128), "tile_lists": ()})() if with_map else None
    return Mods(score_mod=score, mask_mod=mask, block_map=block_map)


@pytest.mark.parametrize("family", ["sm90", "sm80"])
@pytest.mark.parametrize("name", ["relative_bias", "relative_prefix_lm"])
def test_a_plan_launches_the_bytes_the_full_path_packs(launches, family, name):
    """Strided GQA inputs, a negative scale, and (prefix LM) a block map: the plan's launch, at the same and at other
    base pointers, is the full launch's byte for byte, and the output and lse have the full path's shapes."""
    mods = _mods(name, with_map=name != "relative_bias")
    bm, bn, w, s = (128, 128, 12, 2) if family == "sm90" else (128, 32, 8, 2)
    cfg = KernelConfig(128, "bf16", False, bm, bn, w, s, family, score_mod=mods.score_mod.digest,
                       mask_mod=mods.mask_mod.digest if mods.mask_mod is not None else "",
                       block_map=mods.mask_mod is not None)
    mods = mods._replace(block_map=type("Map", (), {"block": (bm, bn), "tile_lists": ()})()
                         if mods.block_map is not None else None)
    for offset in (0, 64):  # another buffer of the same layout: the plan's pointers follow it
        qkv = torch.randn(2, 100 + offset, 3, 8, 128, dtype=torch.bfloat16)[:, offset:]
        q, k, v = qkv[:, :, 0], qkv[:, :60, 1, :2], qkv[:, :60, 2, :2]
        plan = modified.make_mod_plan(cfg, q, k, v, mods, -0.3)
        out, lse = modified.run_mod_plan(plan, q, k, v)
        assert out.shape == q.shape and out.is_contiguous() and lse.shape == (2, 8, 100) and lse.dtype == torch.float32
        serving.launch_prefill(cfg, q, k, v, out, lse, cu_q=None, cu_k=None, max_seqlen_q=100, max_seqlen_k=60,
                               num_splits=1, mods=mods, softmax_scale=-0.3)
        assert len(launches) == 2 and launches[0] == launches[1]
        assert struct.pack("=Q", q.data_ptr()) in launches[0][2] and launches[0][3] == 7
        launches.clear()
        _, no_lse = modified.run_mod_plan(plan, q, k, v, want_lse=False)
        assert no_lse is None and len(launches) == 1
        launches.clear()


def test_a_misaligned_base_pointer_takes_the_full_path(launches):
    mods = _mods("relative_bias", with_map=False)
    cfg = KernelConfig(128, "bf16", False, 128, 128, 12, 2, "sm90", score_mod=mods.score_mod.digest)
    q = torch.randn(1, 65, 2, 128, dtype=torch.bfloat16)
    plan = modified.make_mod_plan(cfg, q[:, 1:], q[:, 1:], q[:, 1:], mods, None)
    odd = torch.randn(1 * 64 * 2 * 128 + 1, dtype=torch.bfloat16)[1:].view(1, 64, 2, 128)  # 2 bytes off
    assert modified.run_mod_plan(plan, odd, odd, odd) is None and not launches

