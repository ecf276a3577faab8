"""The gradient of a score_mod's learnable table (modifier_grads.captured_grads) on CPU tensors, against torch's
autograd of the same attention in float64, plain and deterministic (torch's global mode is left as it was)."""
from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")

from flashgen.checks import Mods  # noqa: E402
from flashgen.modifier_grads import captured_grads  # noqa: E402
from flashgen.modifiers import trace_score_mod  # noqa: E402


@pytest.mark.parametrize("below_autograd", [False, True], ids=["eager", "operator"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_table_gradient_matches_autograd(deterministic, below_autograd):
    """below_autograd: run as a custom operator's body runs (the traced route's backward, under torch.compile), with
    the dispatcher's autograd keys excluded."""
    g = torch.Generator().manual_seed(0)
    batch, n, heads, d = 2, 37, 4, 16
    q, k, v, dout = (torch.randn(batch, n, heads, d, generator=g) for _ in range(4))
    table = (0.3 * torch.randn(heads, 2 * n - 1, generator=g)).requires_grad_(True)

    def bias(score, b, h, q_idx, kv_idx):
        return score + table[h, kv_idx - q_idx + n - 1]

    scale = d ** -0.5
    t64 = table.detach().double().requires_grad_(True)
    qi, ki = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale + t64[:, ki - qi + n - 1][None]
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v.double())
    (out * dout.double()).sum().backward()

    mods = Mods(score_mod=trace_score_mod(bias))
    before = torch.are_deterministic_algorithms_enabled()
    with torch._C._AutoDispatchBelowAutograd() if below_autograd else contextlib.nullcontext():
        (got,) = captured_grads(dout, q, k, v, out.detach().float(), lse.detach().float(), None, False, scale, mods,
                                None, (True,), deterministic)
    assert torch.are_deterministic_algorithms_enabled() == before
    assert got.shape == table.shape and torch.allclose(got.double(), t64.grad, atol=1e-4, rtol=1e-4)
    if deterministic:
        again, = captured_grads(dout, q, k, v, out.detach().float(), lse.detach().float(), None, False, scale, mods,
                                None, (True,), True)
        assert torch.equal(got, again)

