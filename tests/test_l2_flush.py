"""bench.l2_flush without a GPU (torch's CUDA calls stood in for): one scratch of twice L2 per device; the write flush
zeroes it, the read flush only reads it (a sum), so L2 is left holding clean lines."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from flashgen import bench  # noqa: E402


def test_the_write_flush_writes_and_the_read_flush_only_reads(monkeypatch):
    made = []
    real_empty = torch.empty

    def empty(*shape, dtype=None, device=None):
        t = real_empty(*shape, dtype=dtype)  # on the CPU
        t.fill_(7)
        made.append(t)
        return t

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: type("Props", (), {"L2_cache_size": 64})())
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(bench, "_L2_SCRATCH", {})
    total = bench.l2_flush(read=True)()
    assert len(made) == 1 and made[0].numel() == 128 and bool((made[0] == 7).all())
    assert int(total) == 32 * 0x07070707  # every byte read, none written
    bench.l2_flush()()
    assert len(made) == 1 and not made[0].any()  # the same scratch, zeroed
