"""mask_mods read as bands of diagonals: which graphs are bands, and that the built-in masks they map to keep exactly
the scores the mask_mod keeps, on every (q_idx, kv_idx) of several shapes."""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from flashgen.mask_bands import band_of, builtin_for, builtin_mask  # noqa: E402
from flashgen.modifiers import Modifier, trace_mask_mod, trace_score_mod  # noqa: E402

W = 37


def builtin_keep(causal: bool, window: tuple[int, int], sq: int, sk: int) -> torch.Tensor:
    """flash_attn's masks: query i sees keys i + shift - left .. i + shift + right (-1: unbounded; causal: right 0),
    shift = sk - sq."""
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    left, right = window
    right = 0 if causal else right
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        keep &= j <= i + sk - sq + right
    if left >= 0:
        keep &= j >= i + sk - sq - left
    return keep


BANDS = {
    "causal": (lambda b, h, q, kv: q >= kv, (0, math.inf)),
    "causal, reversed": (lambda b, h, q, kv: kv <= q, (0, math.inf)),
    "sliding": (lambda b, h, q, kv: (q >= kv) & (q - kv < W), (0, W - 1)),
    "sliding, le": (lambda b, h, q, kv: (kv <= q) & (q - kv <= W), (0, W)),
    "band both sides": (lambda b, h, q, kv: (kv - q <= 5) & (q - kv <= W), (-5, W)),
    "shifted and scaled": (lambda b, h, q, kv: (2 * q - 2 * kv >= 0 * q) & (q + 3 < kv + 3 + W), (0, W - 1)),
    "halved": (lambda b, h, q, kv: (2 * (q - kv) > -1) & (3 * kv - 3 * q >= -2 * W - 1), (0, (2 * W + 1) // 3)),
    "negated": (lambda b, h, q, kv: -(kv - q) >= 0, (0, math.inf)),
    "look ahead": (lambda b, h, q, kv: kv < q + 4, (-3, math.inf)),
    "everything": (lambda b, h, q, kv: (q >= kv - 100000) & (kv >= q - 100000), (-100000, 100000)),
}


@pytest.mark.parametrize("name", sorted(BANDS))
def test_bands_are_read_from_the_graph(name):
    fn, band = BANDS[name]
    assert band_of(trace_mask_mod(fn)) == band


def test_other_masks_are_not_bands():
    doc = torch.zeros(64, dtype=torch.int32)
    prefix = 9
    others = [
        lambda b, h, q, kv: (q >= kv) | (kv < prefix),      # prefix LM: an or
        lambda b, h, q, kv: doc[q] == doc[kv],               # a captured tensor
        lambda b, h, q, kv: (q - kv).abs() < W,              # abs
        lambda b, h, q, kv: q * 2 >= kv,                     # not a diagonal
        lambda b, h, q, kv: (q >= kv) & (h > 0),             # a head
        lambda b, h, q, kv: q == kv,                         # equality
        lambda b, h, q, kv: q // 2 >= kv // 2,               # a division
        lambda b, h, q, kv: q.float() >= kv.float(),         # floats
        lambda b, h, q, kv: q * kv >= 0,                     # a product of indices
    ]
    for fn in others:
        assert band_of(trace_mask_mod(fn)) is None
    assert band_of(Modifier.from_cuda("q_idx >= kv_idx", "mask")) is None  # CUDA text: no graph to read


@pytest.mark.parametrize("name", sorted(BANDS))
@pytest.mark.parametrize("n", [1, 17, 113, 1023])
def test_builtin_masks_keep_the_same_scores(name, n):
    fn, _ = BANDS[name]
    mask = trace_mask_mod(fn)
    mapped = builtin_mask(band_of(mask), n, n)
    if mapped is None:
        pytest.skip("not mapped")
    causal, window = mapped
    q = torch.arange(n)[:, None]
    kv = torch.arange(n)[None, :]
    want = mask.evaluate(torch.tensor(0), torch.tensor(0), q, kv).expand(n, n)
    assert torch.equal(builtin_keep(causal, window, n, n), want)


def test_only_bands_that_keep_each_querys_own_key_and_square_calls_map():
    assert builtin_mask((0, math.inf), 100, 100) == (True, (-1, -1))
    assert builtin_mask((0, 9), 100, 100) == (True, (9, 0))
    assert builtin_mask((-5, 9), 100, 100) == (False, (9, 5))
    assert builtin_mask((-math.inf, math.inf), 100, 100) == (False, (-1, -1))
    assert builtin_mask((-200, 200), 100, 100) == (False, (-1, -1))  # wider than the call: unbounded
    assert builtin_mask((1, math.inf), 100, 100) is None   # row 0 keeps no key
    assert builtin_mask((-math.inf, -1), 100, 100) is None
    assert builtin_mask((0, math.inf), 100, 101) is None   # top-left and bottom-right alignments differ


def test_builtin_for_a_call_takes_its_score_mod_and_causal_flag():
    """The one decision of the eager and traced routes: a score_mod that changes something keeps the generated kernel,
    one that changes nothing does not, and causal intersects the band with q_idx >= kv_idx."""
    look_ahead = trace_mask_mod(BANDS["look ahead"][0])
    assert builtin_for(look_ahead, None, False, 100, 100) == (False, (-1, 3))
    assert builtin_for(look_ahead, None, True, 100, 100) == (True, (-1, -1))
    assert builtin_for(look_ahead, trace_score_mod(lambda s, b, h, q, kv: s), False, 100, 100) == (False, (-1, 3))
    assert builtin_for(look_ahead, trace_score_mod(lambda s, b, h, q, kv: s * 2), False, 100, 100) is None
    assert builtin_for(look_ahead, None, False, 100, 101) is None


def test_a_band_mask_mod_runs_the_builtin_kernel(monkeypatch):
    """flashgen.attention with a band mask_mod calls the built-in path with the mapped causal / window_size."""
    from flashgen import api

    seen = []
    real = api.attention

    def spy(q, k, v, causal=False, softmax_scale=None, return_lse=False, *args, **kwargs):
        if kwargs.get("mask_mod") is None and kwargs.get("score_mod") is None:
            seen.append((causal, kwargs.get("window_size")))
            return q
        return real(q, k, v, causal, softmax_scale, return_lse, *args, **kwargs)

    monkeypatch.setattr(api, "attention", spy)
    monkeypatch.setattr(api, "check_dense", lambda *a: api.Mods())  # the checks want CUDA tensors: these are CPU ones
    q = torch.zeros(1, 64, 2, 64, dtype=torch.float16)
    fn, _ = BANDS["sliding"]
    api.attention(q, q, q, mask_mod=fn)
    api.attention(q, q, q, mask_mod=BANDS["band both sides"][0], score_mod=lambda s, b, h, qi, kv: s)
    assert seen == [(True, (W - 1, 0)), (False, (W, 5))]
