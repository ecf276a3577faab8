"""score_mod / mask_mod under torch.compile on the GPU: a function calling flashgen.attention with ALiBi (a captured
slope tensor) as score_mod and a document mask (a captured id tensor) as mask_mod, compiled with fullgraph=True
(inductor), gives the eager call's forward and backward bit for bit (deterministic backward), a learnable bias
table's gradient included; the same forward, compiled, captured in a CUDA graph, replays on new inputs and on slopes
changed in place; and the eager results stay within the float64 reference's bar."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

import flashgen  # noqa: E402
from modifier_examples import examples  # noqa: E402
from test_gpu_modifiers import check, documents, qkv  # noqa: E402

SCALE = 0.125
# Made on the GPU by the `tables` fixture (collection needs no GPU): ALiBi reading its per-head slopes from its
# closure, document ids, a learnable bias table.
ALIBI = DOC = BIAS = None


@pytest.fixture(autouse=True, scope="module")
def tables():
    global ALIBI, DOC, BIAS
    ALIBI = examples("cuda", batch=2, heads=8)["alibi"].score_mod
    DOC = documents(2, 400, seed=5)
    BIAS = (0.1 * torch.randn(8, 2 * 400 - 1, device="cuda")).requires_grad_(True)


def document(b, h, q_idx, kv_idx):
    return DOC[b, q_idx] == DOC[b, kv_idx]


def learned_bias(score, b, h, q_idx, kv_idx):
    return ALIBI(score, b, h, q_idx, kv_idx) + BIAS[h, kv_idx - q_idx + 399]


def step(q, k, v):
    return flashgen.attention(q, k, v, causal=True, softmax_scale=SCALE, return_lse=True, score_mod=ALIBI,
                              mask_mod=document)


def train_step(q, k, v):
    return flashgen.attention(q, k, v, causal=True, softmax_scale=SCALE, score_mod=learned_bias, mask_mod=document,
                              deterministic=True)


def fresh(*shape_args, seed):
    return [t.detach().requires_grad_(True) for t in qkv(*shape_args, seed=seed)]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_compiled_forward_equals_eager(dtype):
    q, k, v = qkv(2, 400, 400, 8, 2, 64, dtype, seed=1)
    compiled = torch.compile(step, fullgraph=True)
    with torch.no_grad():
        out, lse = compiled(q, k, v)
        ref, ref_lse = step(q, k, v)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    with torch.no_grad():
        check(q, k, v, SCALE, ALIBI, document, causal=True)  # eager against the float64 reference


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_compiled_backward_equals_eager(dtype):
    """dq, dk, dv and the bias table's gradient: the compiled graph (flashgen::attention_modified_backward) and
    eager autograd (the same kernels and host-side table gradient) agree bit for bit."""
    compiled = torch.compile(train_step, fullgraph=True)
    grads = []
    for fn in (compiled, train_step):
        q, k, v = fresh(2, 400, 400, 8, 2, 64, dtype, seed=2)
        BIAS.grad = None
        out = fn(q, k, v)
        dout = torch.randn(out.shape, generator=torch.Generator(device="cuda").manual_seed(7), device="cuda",
                           dtype=out.dtype)
        out.backward(dout)
        grads.append((out.detach(), q.grad, k.grad, v.grad, BIAS.grad.clone()))
    for got, want in zip(*grads):
        assert torch.equal(got, want)


def test_cuda_graph_of_the_compiled_forward_replays():
    """The compiled forward captured in a CUDA graph: replays on new q, k, v copied into the static inputs and on
    slopes changed in place give what eager calls give on the same values (the document mask's block map is the
    one built before the capture: its ids stay)."""
    slopes = ALIBI.__closure__[ALIBI.__code__.co_freevars.index("slopes")].cell_contents
    compiled = torch.compile(step, fullgraph=True)
    static = [t.clone() for t in qkv(2, 400, 400, 8, 2, 64, "bf16", seed=3)]
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: compile, kernels loaded, block map built
                compiled(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, lse = compiled(*static)
        saved_slopes = slopes.clone()
        try:
            for seed in (4, 5):
                for dst, src in zip(static, qkv(2, 400, 400, 8, 2, 64, "bf16", seed=seed)):
                    dst.copy_(src)
                graph.replay()
                ref, ref_lse = step(*static)
                assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
            slopes.mul_(2.0)  # the kernel reads the slopes at each launch
            graph.replay()
            ref, ref_lse = step(*static)
            assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
        finally:
            slopes.copy_(saved_slopes)
