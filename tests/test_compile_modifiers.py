"""flashgen.attention with a score_mod or mask_mod where it is traced: FakeTensorMode, meta tensors and torch.compile
(the flashgen::attention_modified operator's fake implementation; no GPU)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the operator tests need torch (a CPU build is enough)")

import flashgen  # noqa: E402
from flashgen import modifiers  # noqa: E402
from flashgen.modifiers import ModifierError  # noqa: E402
from flashgen.traced_modifiers import attention_modified_op, graph_modifiers  # noqa: E402

from modifier_examples import WINDOW, examples  # noqa: E402

OP = torch.ops.flashgen.attention_modified.default
BACKWARD_OP = torch.ops.flashgen.attention_modified_backward.default
EX = examples("meta", batch=2, heads=8)
SCALE = 2  # a Python number a score_mod reads: a constant of its trace


def scaled_alibi(score, b, h, q_idx, kv_idx):
    return score * SCALE + EX["alibi"].score_mod(score, b, h, q_idx, kv_idx) - score


def meta(*shape, dtype=torch.bfloat16, grad=False):
    return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=grad)


def recorded(fn, *args, fullgraph=True):
    """(fn compiled with dynamo's eager backend, run on args; the graphs dynamo made)."""
    from torch._dynamo.testing import EagerAndRecordGraphs

    backend = EagerAndRecordGraphs()
    out = torch.compile(fn, fullgraph=fullgraph, backend=backend)(*args)
    return out, backend.graphs


def op_nodes(graphs, target=OP):
    return [n for g in graphs for n in g.graph.nodes if n.op == "call_function" and n.target is target]


def test_fake_cuda_tensors_give_shapes_and_register_the_modifiers():
    """Fake CUDA tensors (the tables too): fake out and lse of the right shapes, and the traced modifiers
    registered under the digests the operator looks up."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        slopes = torch.empty(8, device="cuda")
        doc = torch.zeros(2, 96, dtype=torch.int32, device="cuda")

        def alibi(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx - kv_idx).abs()

        def document(b, h, q_idx, kv_idx):
            return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)

        q = torch.empty(2, 80, 8, 64, dtype=torch.float16, device="cuda")
        k = torch.empty(2, 96, 2, 64, dtype=torch.float16, device="cuda")
        out, lse = flashgen.attention(q, k, k, score_mod=alibi, mask_mod=document, return_lse=True)
        assert isinstance(out, FakeTensor) and out.shape == q.shape and out.dtype == q.dtype
        assert out.device == q.device and lse.shape == (2, 8, 80) and lse.dtype == torch.float32
        score_digest, mask_digest, n_score, paths, _ = graph_modifiers(alibi, document)
    assert n_score == 1 and paths == (("score", ("closure", 0)), ("mask", ("closure", 0)))
    score, mask = modifiers.registered((score_digest, mask_digest))
    assert score.kind == "score" and "score_mod_t0[" in score.expr and mask.kind == "mask"


def test_opcheck_on_meta_tensors():
    """The operator's schema, fake implementation and autograd registration, as torch.library checks them."""
    alibi = EX["alibi"].score_mod
    digest = modifiers.trace_cached(alibi, "score").digest
    slopes = alibi.__closure__[0].cell_contents
    args = (meta(2, 64, 8, 64), meta(2, 64, 2, 64), meta(2, 64, 2, 64), [slopes], digest, "", True, None, -1, -1,
            0.0, None, False, [False])
    torch.library.opcheck(attention_modified_op, args)
    out, lse = attention_modified_op(*args)
    assert out.shape == (2, 64, 8, 64) and lse.shape == (2, 8, 64) and lse.dtype == torch.float32


@pytest.mark.parametrize("name", ["alibi_causal", "softcap_document", "relative_prefix_lm", "prefix_lm", "softcap"])
def test_compile_fullgraph_puts_the_operator_in_the_graph(name):
    """torch.compile(fullgraph=True): one graph, the operator in it, the tables the modifiers read its inputs."""
    ex = EX[name]

    def block(q, k, v):
        return flashgen.attention(q, k, v, score_mod=ex.score_mod, mask_mod=ex.mask_mod).float().sum(-1)

    out, graphs = recorded(block, meta(2, 64, 8, 64), meta(2, 64, 2, 64), meta(2, 64, 2, 64))
    assert out.shape == (2, 64, 8) and out.dtype == torch.float32
    (node,) = op_nodes(graphs)
    tables = node.args[3]
    want = sum(len(modifiers.trace_cached(f, kind).tensors)
               for f, kind in ((ex.score_mod, "score"), (ex.mask_mod, "mask")) if f is not None)
    assert len(tables) == want and all(t.op == "placeholder" for t in tables)
    assert node.args[4] == (modifiers.trace_cached(ex.score_mod, "score").digest if ex.score_mod else "")
    assert node.args[5] == (modifiers.trace_cached(ex.mask_mod, "mask").digest if ex.mask_mod else "")


@pytest.mark.parametrize("name, target, args", [
    ("causal", "attention", (True,)),
    ("sliding_window", "attention_mods", (True, None, WINDOW, 0))])
def test_compiled_band_masks_take_the_builtin_operators(name, target, args):
    """Under torch.compile as eagerly: a mask_mod that keeps a band of diagonals (q_idx and kv_idx of one length)
    is the built-in causal / window operator in the graph, not flashgen::attention_modified; unequal lengths keep
    the modifier operator."""
    mask = EX[name].mask_mod

    def block(q, k, v):
        return flashgen.attention(q, k, v, mask_mod=mask).float().sum(-1)

    _, graphs = recorded(block, meta(2, 64, 8, 64), meta(2, 64, 2, 64), meta(2, 64, 2, 64))
    assert not op_nodes(graphs)
    (node,) = op_nodes(graphs, getattr(torch.ops.flashgen, target).default)
    assert tuple(node.args[3:3 + len(args)]) == args
    _, graphs = recorded(block, meta(2, 64, 8, 64), meta(2, 96, 2, 64), meta(2, 96, 2, 64))
    assert len(op_nodes(graphs)) == 1


def test_a_changed_constant_recompiles_with_a_new_trace():
    """A Python number the score_mod reads is guarded: changing it recompiles with the new trace, never reusing the
    stale one."""
    global SCALE
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("eager")
    digests = []

    def backend(gm, inputs):
        digests.extend(n.args[4] for n in gm.graph.nodes if n.target is OP)
        return counter(gm, inputs)

    block = torch.compile(lambda q, k: flashgen.attention(q, k, k, score_mod=scaled_alibi), fullgraph=True,
                          backend=backend)
    q, k = meta(1, 32, 8, 64), meta(1, 32, 8, 64)
    block(q, k)
    block(q, k)
    assert counter.frame_count == 1
    old = SCALE
    try:
        SCALE = 3
        block(q, k)
    finally:
        SCALE = old
    assert counter.frame_count == 2 and len(set(digests)) == 2


def test_compiled_autograd_reaches_the_backward_operator():
    """q, k, v and a float table the score_mod reads require grad: the compiled backward runs
    flashgen::attention_modified_backward, and every one gets a gradient of its shape."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    bias = torch.zeros(8, 128, device="meta", requires_grad=True)

    def learned(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + 64]

    forward_graphs, backward_graphs = [], []

    def keep(graphs):
        def compiler(gm, _):
            graphs.append(gm)
            return make_boxed_func(gm)
        return compiler

    backend = aot_autograd(fw_compiler=keep(forward_graphs), bw_compiler=keep(backward_graphs))
    q, k, v = meta(2, 64, 8, 64, grad=True), meta(2, 64, 2, 64, grad=True), meta(2, 64, 2, 64, grad=True)
    loss = torch.compile(lambda q, k, v: flashgen.attention(q, k, v, score_mod=learned, mask_mod=EX["causal"].mask_mod)
                         .float().sum(), fullgraph=True, backend=backend)(q, k, v)
    loss.backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    assert bias.grad.shape == bias.shape and bias.grad.dtype == bias.dtype
    # The table's gradient is asked for as dynamo saw it require one: decided before the operator (its autograd
    # context sees stand-ins) and handed from the forward's call to the backward's.
    (forward,), (backward,) = op_nodes(forward_graphs), op_nodes(backward_graphs, BACKWARD_OP)
    assert list(forward.args[-1]) == [True] and list(backward.args[-1]) == [True]


def test_a_modifier_made_inside_the_compiled_function_breaks_the_graph():
    """dynamo cannot hand a function made inside the compiled code to the tracer as a constant: fullgraph=True
    refuses it, the default compiles around a graph break (the operator still in a graph)."""
    slopes = torch.ones(8, device="meta")

    def block(q, k, v, slopes):
        def alibi(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx - kv_idx)

        return flashgen.attention(q, k, v, score_mod=alibi)

    args = (meta(1, 32, 8, 64), meta(1, 32, 8, 64), meta(1, 32, 8, 64), slopes)
    with pytest.raises(Exception, match="disable"):
        recorded(block, *args)
    out, graphs = recorded(block, *args, fullgraph=False)
    assert out.shape == (1, 32, 8, 64) and len(op_nodes(graphs)) == 1


def test_traced_refusals():
    q = meta(1, 32, 8, 64)

    base = torch.zeros(8, device="meta")

    def made_while_running(score, b, h, q_idx, kv_idx):
        return score + (base + 1)[h]  # a table no path leads to

    with pytest.raises(ModifierError, match="cannot reach"):
        flashgen.attention(q, q, q, score_mod=made_while_running)
    with pytest.raises(NotImplementedError, match="block_mask is for eager calls"):
        flashgen.attention(q, q, q, mask_mod=EX["causal"].mask_mod, block_mask=object())
    with pytest.raises(ValueError, match="does not combine with softcap"):
        flashgen.attention(q, q, q, score_mod=EX["alibi"].score_mod, softcap=5.0)
    doc = torch.zeros(64, dtype=torch.float32, device="meta", requires_grad=True)

    def soft_document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    with pytest.raises(NotImplementedError, match="a mask has no gradient"):
        flashgen.attention(q, q, q, mask_mod=soft_document)


class Biased(torch.nn.Module):
    """FlexAttention's usual shape: the modifier made in forward, reading the module's parameter and settings."""

    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(8, 127, device="meta"))
        self.window = 16

    def forward(self, q, k, v):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score + self.bias[h, q_idx - kv_idx + 63]

        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx <= self.window) & (q_idx >= kv_idx)

        return flashgen.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)


def test_a_modules_modifiers_reach_its_parameters_through_attributes():
    """Modifiers made in a module's forward read its parameter through `self`: eager on meta tensors, and compiled
    (a graph break at the trace, the parameter an input of the operator and given its gradient); a changed setting
    recompiles."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    model = Biased()
    q = meta(1, 64, 8, 64, grad=True)
    assert model(q, q, q).shape == q.shape
    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm)

    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    compiled(q, q, q).float().sum().backward()
    assert model.bias.grad.shape == model.bias.shape
    assert op_nodes(graphs) and op_nodes(graphs, BACKWARD_OP)
    forwards = len(op_nodes(graphs))
    model.window = 8
    compiled(q, q, q)
    assert len(op_nodes(graphs)) == forwards + 1  # a new graph with the new mask


def test_closures_from_a_factory_reuse_the_graph_until_what_they_read_differs():
    """New closures of the same code: new tables of the same dtype reuse the compiled graph (they are its inputs); a
    different number closed over, or a table of another dtype, recompiles with the new digest."""
    def window(w):
        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx <= w) & (q_idx >= kv_idx)
        return mask_mod

    def per_head(table):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score + table[h]
        return score_mod

    from torch._dynamo.testing import EagerAndRecordGraphs

    backend = EagerAndRecordGraphs()
    block = torch.compile(lambda q, m, s: flashgen.attention(q, q, q, mask_mod=m, score_mod=s), fullgraph=True,
                          backend=backend)
    q = meta(1, 32, 8, 64)
    seen = []
    for w, dtype in ((4, torch.float32), (4, torch.float32), (8, torch.float32), (8, torch.float16)):
        block(q, window(w), per_head(torch.zeros(8, dtype=dtype, device="meta")))
        seen.append((len(backend.graphs), op_nodes(backend.graphs[-1:])[0].args[4:6]))
    assert [n for n, _ in seen] == [1, 1, 2, 3]
    digests = [d for _, d in seen]
    assert digests[2][0] == digests[1][0] and digests[2][1] != digests[1][1]  # the mask's number changed
    assert digests[3][0] != digests[2][0] and digests[3][1] == digests[2][1]  # the table's dtype changed


def test_alignment_check_traces_on_real_tensors_without_a_graph_break():
    """torch.compile traces real tensors with symbolic data pointers: the input checks skip the alignment test there
    (the operator's implementation makes it on the real tensors) instead of breaking the graph."""
    from flashgen import checks

    t = torch.zeros(64, dtype=torch.bfloat16)
    (doubled, flagged), graphs = recorded(lambda x: (x * 2, checks.misaligned(x)), t)
    assert flagged is False and len(graphs) == 1 and torch.equal(doubled, t)
    assert checks.misaligned(t[1:]) and not checks.misaligned(t)


def test_an_identity_score_mod_is_no_modifier(monkeypatch):
    """A score_mod that returns the score unchanged traces to nothing to compile: the call is the plain kernel's
    (beside a mask_mod, the mask_mod's kernel alone)."""
    from flashgen import api
    from flashgen.checks import Mods

    assert modifiers.trace_score_mod(lambda score, b, h, q_idx, kv_idx: score).is_identity
    assert not modifiers.trace_score_mod(lambda score, b, h, q_idx, kv_idx: score * 2).is_identity
    assert not modifiers.trace_score_mod(EX["relative_bias"].score_mod).is_identity
    calls = []

    class Ops:
        def attention(self, q, k, v, causal, scale, arch, return_lse, deterministic):
            calls.append(("plain", causal, scale))
            return q, None

        def dense_mods_forward(self, q, k, v, causal, scale, mods, return_lse, arch):
            calls.append(("modified", mods.score_mod, mods.mask_mod.digest))
            return q, None

        def modifier_plan(self, q, k, v, causal, scale, mods, arch):  # none: the call takes dense_mods_forward
            return None

    monkeypatch.setattr(api, "_ops", lambda: Ops())
    monkeypatch.setattr(api, "check_dense", lambda *a: Mods())
    q = torch.zeros(1, 64, 4, 64, dtype=torch.bfloat16)
    api.attention(q, q, q, causal=True, softmax_scale=0.5, score_mod=lambda score, b, h, q_idx, kv_idx: score)
    mask = modifiers.trace_mask_mod(EX["document"].mask_mod)  # not a band of diagonals (those run built-in kernels)
    api.attention(q, q, q, score_mod=lambda score, b, h, q_idx, kv_idx: score, mask_mod=EX["document"].mask_mod)
    assert calls == [("plain", True, 0.5), ("modified", None, mask.digest)]
