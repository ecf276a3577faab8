"""A decode step's plan without a GPU: attention_with_kvcache and attention() with one query token repeat an earlier
call's checks and choices by its signature, and a call of another signature, or one a plan does not serve, takes
the full path (meta tensors; the driver, the kernel choice and the launches stood in for)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import flashgen  # noqa: E402
from flashgen import api, resolve  # noqa: E402
from flashgen.checks import wants_grad  # noqa: E402
from flashgen.kernels import serving  # noqa: E402

BF16 = torch.bfloat16


class Decode:
    """The stand-ins: which calls took the full path (kvcache_launch) and which a plan (run_plan), and the launches."""

    def __init__(self, monkeypatch):
        self.full, self.planned, self.launches, self.stamp = 0, 0, [], ("store", 1)

        class Fn:
            def launch(fn, grid, threads, params, stream, programmatic=False):
                self.launches.append(grid)

            def prepared(fn, grid, threads, programmatic=False):
                return type("Launch", (), {"launch": lambda _, stream, params: self.launches.append(grid)})()

        real_launch, real_run = api.kvcache_launch, api.run_plan

        def full(*a, **k):
            self.full += 1
            return real_launch(*a, **k)

        def planned(*a, **k):
            self.planned += 1
            return real_run(*a, **k)

        monkeypatch.setattr(api, "kvcache_launch", full)
        monkeypatch.setattr(api, "run_plan", planned)
        monkeypatch.setattr(api, "arch_and_slots", lambda device: ("sm90", 132))
        monkeypatch.setattr(api, "tuned_decode", lambda *a: None)  # the rules' choice, whatever the store holds
        monkeypatch.setattr(resolve, "gpu_stamp", lambda device: (("NVIDIA H200", "sm90"), self.stamp))
        monkeypatch.setattr(serving, "_functions", lambda cfg, arch, ctx: (Fn(), Fn() if "combine" in cfg.kernel_names
                                                                           else None))
        monkeypatch.setattr(serving, "arch_and_slots", lambda device: ("sm90", 132))
        monkeypatch.setattr(serving.driver, "use_device", lambda device: None)
        monkeypatch.setattr(serving.driver, "make_current", lambda ctx, state=None: None)
        monkeypatch.setattr(serving.driver, "primary_context", lambda device: 0x1000)
        monkeypatch.setattr(serving.driver, "primary_context_id", lambda device: 1)
        monkeypatch.setattr(serving, "current_stream", lambda device: 7)
        monkeypatch.setattr(serving, "error_word", lambda device: 0x5000)
        monkeypatch.setattr(serving, "capturing", lambda: False)
        monkeypatch.setattr(serving, "_workspace", lambda device, stream, floats, fresh: torch.empty(floats,
                                                                                                   device="meta"))
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        monkeypatch.setattr(api, "_decode_shaped",
                            lambda q, k, v, sinks=None: q.shape[1] == 1 and not wants_grad(q, k, v))
        monkeypatch.setattr(api, "_kv_plans", {})
        monkeypatch.setattr(api, "_decode_routes", {})
        monkeypatch.setattr(api, "_lengths", {})


def meta(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def step(q=None, kc=None, **kw):
    """A decode step: batch 2, one query token, 8 query heads on 2 KV heads, d128, a cache of 4096."""
    q = meta(2, 1, 8, 128) if q is None else q
    kc = meta(2, 4096, 2, 128) if kc is None else kc
    kw.setdefault("cache_seqlens", LENS)
    return flashgen.attention_with_kvcache(q, kc, torch.empty_like(kc), **kw)


LENS = torch.empty(2, dtype=torch.int32, device="meta")


def test_reload_forgets_the_plans(monkeypatch):
    """After flashgen.reload() a repeated signature chooses again (a kernel chosen another way since, a swept tile, a
    fixed num_splits that no store stamp guards, is then what runs)."""
    got = Decode(monkeypatch)
    with torch.no_grad():
        step(num_splits=4)
        step(num_splits=4)
        assert (got.full, got.planned, len(api._kv_plans)) == (1, 1, 1)
        flashgen.reload()
        assert not api._kv_plans
        step(num_splits=4)
        assert (got.full, got.planned, len(api._kv_plans)) == (2, 1, 1)


def test_a_repeated_signature_runs_its_plan(monkeypatch):
    got = Decode(monkeypatch)
    with torch.no_grad():
        first = step()
        assert (got.full, got.planned, len(api._kv_plans)) == (1, 0, 1)
        launches = list(got.launches)
        got.launches.clear()
        for _ in range(3):  # new tensors of the same signature each step, as a decode loop makes them
            out = step(cache_seqlens=torch.empty(2, dtype=torch.int32, device="meta"))
            assert out.shape == first.shape and out.dtype == BF16 and out.device == first.device
        assert (got.full, got.planned, len(api._kv_plans)) == (1, 3, 1)
        assert got.launches == launches * 3  # the same grids (main and combine)
        out, lse = step(return_lse=True)
        out, lse = step(return_lse=True)
        assert (got.full, got.planned) == (2, 4) and lse.shape == (2, 8, 1) and lse.dtype == torch.float32
        for _ in range(2):  # a dense q of another layout (heads outermost): its output contiguous all the same
            out = step(q=meta(8, 1, 2, 128).permute(2, 1, 0, 3))
            assert out.shape == (2, 1, 8, 128) and out.is_contiguous()
        assert (got.full, got.planned) == (3, 5)


@pytest.mark.parametrize("other", ["cache length", "batch", "strides", "dtype", "lengths' dtype", "causal", "scale",
                                   "splits", "window", "softcap", "paged"])
def test_another_signature_takes_the_full_path(monkeypatch, other):
    """A call that differs from a planned one in any shape, stride, dtype or option is checked and chosen anew (and
    planned in its turn)."""
    got = Decode(monkeypatch)
    kc = meta(2, 4096, 2, 128)
    table = torch.empty(2, 4, dtype=torch.int32, device="meta")
    call = {"cache length": dict(kc=meta(2, 2048, 2, 128)),
            "batch": dict(q=meta(1, 1, 8, 128), kc=meta(1, 4096, 2, 128),
                          cache_seqlens=torch.empty(1, dtype=torch.int32, device="meta")),
            "strides": dict(kc=meta(2, 2, 4096, 128).transpose(1, 2)),
            "dtype": dict(q=meta(2, 1, 8, 128, dtype=torch.float16), kc=meta(2, 4096, 2, 128, dtype=torch.float16)),
            "lengths' dtype": dict(cache_seqlens=torch.empty(2, dtype=torch.int64, device="meta")),
            "causal": dict(causal=True), "scale": dict(softmax_scale=0.1), "splits": dict(num_splits=3),
            "window": dict(window_size=(256, 0)), "softcap": dict(softcap=30.0),
            "paged": dict(kc=meta(8, 1024, 2, 128), block_table=table)}[other]
    with torch.no_grad():
        step(kc=kc)
        step(kc=kc)
        assert (got.full, got.planned) == (1, 1)
        if other == "lengths' dtype":
            with pytest.raises(TypeError, match="int32"):
                step(**call)
            return
        step(**call)
        assert (got.full, got.planned, len(api._kv_plans)) == (2, 1, 2)
        step(**call)
        assert (got.full, got.planned) == (2, 2)


def test_what_a_plan_does_not_serve_takes_the_full_path(monkeypatch):
    """A gradient wanted is refused even where a plan exists; an append or an int cache_seqlens take the full path
    every call."""
    got = Decode(monkeypatch)
    q = meta(2, 1, 8, 128)
    step(q=q)
    step(q=q)
    assert (got.full, got.planned) == (1, 1)
    with pytest.raises(RuntimeError, match="cannot give this input's gradient"):
        step(q=meta(2, 1, 8, 128).requires_grad_())
    with torch.no_grad():
        step(q=meta(2, 1, 8, 128).requires_grad_())  # no gradient wanted: the plan
    assert (got.full, got.planned) == (1, 2)
    new = meta(2, 1, 2, 128)
    monkeypatch.setattr(api, "append_kv", lambda *a: None)
    for kw in (dict(k=new, v=new), dict(cache_seqlens=100)):
        step(**kw)
        step(**kw)
    assert (got.full, got.planned, len(api._kv_plans)) == (5, 2, 1)


def test_sinks_are_planned_with_their_layout(monkeypatch):
    """learnable_sink (gpt-oss's decode steps): its layout is part of the signature and its pointer is filled per
    call; sinks of another dtype make their own plan; sinks that want a gradient take the full path, which refuses
    them. attention() with one query token and sinks takes its route the same way."""
    got = Decode(monkeypatch)
    with torch.no_grad():
        for _ in range(2):
            step(learnable_sink=torch.zeros(8, device="meta"))  # new sinks each step: the same plan
        assert (got.full, got.planned) == (1, 1)
        step(learnable_sink=torch.zeros(8, dtype=BF16, device="meta"))
        step()
        assert (got.full, got.planned, len(api._kv_plans)) == (3, 1, 3)
    with pytest.raises(RuntimeError, match="cannot give this input's gradient"):
        step(learnable_sink=torch.zeros(8, device="meta").requires_grad_())
    assert got.planned == 1
    k = meta(2, 4096, 2, 128)
    with torch.no_grad():  # the first call finds the fp32 sinks' plan above (full lengths are lengths of its layout)
        for _ in range(3):
            flashgen.attention(meta(2, 1, 8, 128), k, k, learnable_sink=torch.zeros(8, device="meta"))
    assert (got.full, got.planned, len(api._decode_routes)) == (3, 4, 1)


def test_a_store_change_makes_a_new_plan(monkeypatch):
    """A plan chosen with the tuned store (num_splits=0) holds while the store's stamp is the same, looked at once a
    STORE_CHECK_S; a plan with its split count given does not look."""
    got = Decode(monkeypatch)
    with torch.no_grad():
        step()
        step()
        plan = next(iter(api._kv_plans.values()))
        assert plan.tracks_store and plan.stamp == ("store", 1)
        got.stamp = ("store", 2)
        step()  # looked at less than STORE_CHECK_S ago: the plan
        assert (got.full, got.planned) == (1, 2)
        plan.look_after = 0.0
        step()
        assert (got.full, got.planned) == (2, 2) and next(iter(api._kv_plans.values())) is not plan
        step(num_splits=2)
        split = api._kv_plans[max(api._kv_plans, key=lambda k: k[-2])]
        assert not split.tracks_store


def test_attention_with_one_query_token_takes_its_route(monkeypatch):
    """attention(q, k, v) shaped like a decode step: the first call plans attention_with_kvcache over kept full
    lengths; the calls after go straight to the plan, one per signature; a gradient wanted takes the operator."""
    got = Decode(monkeypatch)
    q, k = meta(2, 1, 8, 128), meta(2, 4096, 2, 128)
    with torch.no_grad():
        first = flashgen.attention(q, k, torch.empty_like(k))
        assert (got.full, got.planned, len(api._decode_routes)) == (1, 0, 1)
        shaped, real = [], api._decode_shaped
        monkeypatch.setattr(api, "_decode_shaped", lambda *a, **kw: shaped.append(1) or real(*a, **kw))
        for _ in range(2):
            out = flashgen.attention(meta(2, 1, 8, 128), meta(2, 4096, 2, 128), meta(2, 4096, 2, 128))
            assert out.shape == first.shape
        assert (got.full, got.planned, shaped) == (1, 2, [])  # not even asked whether it is decode-shaped
        out, lse = flashgen.attention(q, k, k, return_lse=True)
        assert (got.full, len(api._decode_routes)) == (2, 2) and lse.shape == (2, 8, 1)
    ops = []
    monkeypatch.setattr(api, "_ops", lambda: type("Ops", (), {"attention": staticmethod(
        lambda *a: ops.append(a) or (a[0], None))}))
    flashgen.attention(q.requires_grad_(), k, k)
    assert len(ops) == 1 and got.planned == 2
