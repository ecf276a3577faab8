"""flashgen.modifiers: FlexAttention-style score_mod / mask_mod functions traced into a graph, written out as CUDA
text, differentiated by the score, and computed on the host by the same graph (checked here against the user's
own function run on torch tensors)."""
from __future__ import annotations

import math
import subprocess

import pytest

torch = pytest.importorskip("torch")

from flashgen import compile as fcompile  # noqa: E402
from flashgen.render import template_env  # noqa: E402
from flashgen.modifiers import (Captured, Modifier, ModifierError, index_layout, inputs_used,  # noqa: E402
                                trace_mask_mod, trace_score_mod)

N = 96  # sequence length of the grids
HEADS, BATCH = 4, 2


def grid(n: int = 4000, seed: int = 0, scale: float = 4.0):
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, BATCH, (n,), generator=g)
    h = torch.randint(0, HEADS, (n,), generator=g)
    q = torch.randint(0, N, (n,), generator=g)
    kv = torch.randint(0, N, (n,), generator=g)
    score = torch.randn(n, generator=g) * scale
    return score, b, h, q, kv


# ------------------------------------------------------------------------------------------------ the examples

def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


WINDOW = 17


def sliding_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)


PREFIX = 20


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < PREFIX) | (q_idx >= kv_idx)


DOC = torch.sort(torch.randint(0, 5, (N,), generator=torch.Generator().manual_seed(1))).values.to(torch.int32)


def document(b, h, q_idx, kv_idx):
    return (DOC[q_idx] == DOC[kv_idx]) & (q_idx >= kv_idx)


PREFIXES = torch.tensor([12, 40], dtype=torch.int64)


def prefix_per_batch(b, h, q_idx, kv_idx):
    return (kv_idx < PREFIXES[b]) | (q_idx >= kv_idx)


BLOCK = 16
BLOCKS = torch.rand(N // BLOCK, N // BLOCK, generator=torch.Generator().manual_seed(2)) < 0.4


def block_sparse(b, h, q_idx, kv_idx):
    return BLOCKS[q_idx // BLOCK, kv_idx // BLOCK] | (q_idx // BLOCK == kv_idx // BLOCK)


SLOPES = torch.tensor([2.0 ** (-8 * (i + 1) / HEADS) for i in range(HEADS)])


def alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)


CAP = 20.0


def softcap(score, b, h, q_idx, kv_idx):
    return CAP * torch.tanh(score / CAP)


REL = torch.randn(HEADS, 2 * N - 1, generator=torch.Generator().manual_seed(3))


def relative_bias(score, b, h, q_idx, kv_idx):
    return score + REL[h, q_idx - kv_idx + N - 1]


BUCKETS, MAX_DISTANCE = 32, 64
T5 = torch.randn(BUCKETS, HEADS, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)


def t5_bucket(rel):
    """T5's bidirectional relative-position bucket (integers in, an integer bucket out)."""
    half = BUCKETS // 2
    ret = (rel > 0).to(torch.long) * half
    n = torch.abs(rel)
    max_exact = half // 2
    large = max_exact + (torch.log(n.float() / max_exact) / math.log(MAX_DISTANCE / max_exact)
                         * (half - max_exact)).to(torch.long)
    large = torch.minimum(large, torch.full_like(large, half - 1))
    return ret + torch.where(n < max_exact, n, large)


def t5_bias(score, b, h, q_idx, kv_idx):
    return score + T5[t5_bucket(kv_idx - q_idx), h]


def leaky(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx >= kv_idx, score * 2.0, 0.25 * score - 1.0) + torch.exp(-torch.abs(score))


MASKS = [causal, sliding_window, prefix_lm, document, prefix_per_batch, block_sparse]
SCORES = [alibi, softcap, relative_bias, t5_bias, leaky]


@pytest.mark.parametrize("fn", MASKS, ids=lambda f: f.__name__)
def test_mask_mod_agrees_with_the_function(fn):
    m = trace_mask_mod(fn)
    assert m.kind == "mask" and m.grad_expr is None
    _, b, h, q, kv = grid()
    expected = fn(b, h, q, kv)
    got = m.evaluate(b, h, q, kv)
    assert got.dtype == torch.bool and torch.equal(got, expected)
    assert 0 < int(expected.sum()) < expected.numel()  # the grid sees both answers


@pytest.mark.parametrize("fn", SCORES, ids=lambda f: f.__name__)
def test_score_mod_agrees_with_the_function(fn):
    m = trace_score_mod(fn)
    assert m.kind == "score"
    score, b, h, q, kv = grid()
    expected = fn(score, b, h, q, kv)
    got = m.evaluate(score, b, h, q, kv)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected.float(), rtol=1e-5, atol=1e-5)


def test_t5_bias_reaches_many_buckets():
    """The T5 grid exercises log, the cast, the min and both where branches (not only the exact buckets)."""
    _, _, _, q, kv = grid()
    buckets = t5_bucket(kv - q)
    assert len(set(buckets.tolist())) > 20


def test_captured_tensors_are_described():
    m = trace_score_mod(relative_bias)
    assert m.captured == (Captured("REL", "score_mod_t0", "float32", (HEADS, 2 * N - 1), (2 * N - 1, 1), "s1"),)
    assert "score_mod_t0[" in m.expr and "score_mod_t0_s1" in m.expr and "REL" not in m.expr
    index = m.expr.partition("score_mod_t0[")[2]  # the offset is computed in 64 bits from the inputs up
    assert "static_cast<long long>(q_idx) - static_cast<long long>(kv_idx)" in index
    # the sm90 forward's: every element below 2^31, so a 32-bit offset, the last stride 1
    index = m.narrow_expr.partition("score_mod_t0[")[2]
    assert "static_cast<unsigned>(q_idx) - static_cast<unsigned>(kv_idx)" in index and "long long" not in index
    assert "score_mod_t0_s0" in m.narrow_expr and "score_mod_t0_s1" not in m.narrow_expr
    assert m.params == "const float* __restrict__ score_mod_t0, long long score_mod_t0_s0, long long score_mod_t0_s1"
    doc = trace_mask_mod(document)
    assert [(c.name, c.dtype, c.rank) for c in doc.captured] == [("DOC", "int32", 1)]  # read twice, one argument
    t5 = trace_score_mod(t5_bias)
    assert t5.captured[0].c_type == "__nv_bfloat16"


def test_a_captured_tensors_offsets_are_32_bit_only_below_2_to_the_31():
    """index_layout: a stride-1 dimension takes no product and a stride-0 one no term; a tensor with an element at
    2^31 or past it, or a negative stride, keeps 64-bit offsets with every stride passed. A kernel generated for one
    layout refuses a tensor of another (Captured.fits), and the layout is part of the digest."""
    def reads(table):
        return lambda score, b, h, q_idx, kv_idx: score + table[h, q_idx - kv_idx + N - 1]

    small = trace_score_mod(reads(REL))
    assert small.captured[0].layout == "s1"
    edge = torch.empty(HEADS, 2**29, device="meta")  # the last element at 2^31 - 1: still 32-bit
    assert trace_score_mod(reads(edge)).captured[0].layout == "s1"
    wide_table = torch.empty(HEADS, 2**29 + 1, device="meta")  # the last element at 2^31 + 3
    wide = trace_score_mod(reads(wide_table))
    assert wide.captured[0].layout == "" and wide.narrow_expr == "" and wide.digest != small.digest
    rows = REL[:1].expand(HEADS, -1)  # one row for every head: stride 0
    zero = trace_score_mod(reads(rows))
    assert zero.captured[0].layout == "01" and "score_mod_t0_s0" not in zero.narrow_expr
    assert index_layout((HEADS, 8), (8, -1)) == "" and index_layout((), ()) == ""  # a negative stride; a scalar
    score, b, h, q, kv = grid()
    torch.testing.assert_close(zero.evaluate(score, b, h, q, kv), score + rows[h, q - kv + N - 1])
    assert trace_score_mod(softcap).narrow_expr == ""  # nothing read: one expression
    c = small.captured[0]
    assert c.fits(REL) and c.fits(torch.randn_like(REL)) and not c.fits(REL.t().contiguous().t())
    assert c.fits(edge) and not c.fits(wide_table) and wide.captured[0].fits(REL)


def linear_distance(score, b, h, q_idx, kv_idx):
    """Index arithmetic turned into floats: a constant and both signs (the split form's one conversion per row)."""
    return score - 0.125 * (q_idx - kv_idx - 7) + (kv_idx + 3).float() * SLOPES[h] - (-q_idx) * 0.5


def overflowing(score, b, h, q_idx, kv_idx):
    """A bias read at kv_idx through products past 2^32 (exact modulo 2^32, as the 32-bit offset computes them)."""
    return score + REL[h, q_idx * 2**30 - (q_idx - 1) * 2**30 + kv_idx - 2**30]


def test_captured_tensor_strides_follow_the_view():
    table = torch.randn(8, HEADS)
    m = trace_score_mod(lambda score, b, h, q_idx, kv_idx: score * table.t()[h, q_idx % 8])
    assert m.captured[0].strides == (1, HEADS) and m.captured[0].shape == (HEADS, 8)
    score, b, h, q, kv = grid()
    torch.testing.assert_close(m.evaluate(score, b, h, q, kv), score * table.t()[h, q % 8])


def test_chained_indexing_and_explicit_names():
    table = torch.randn(HEADS, 2 * N)
    m = trace_score_mod(lambda s, b, h, q, kv: s + table[h][q - kv + N], captured={"rel": table})
    assert m.captured[0].name == "rel" and m.captured[0].rank == 2
    score, b, h, q, kv = grid()
    torch.testing.assert_close(m.evaluate(score, b, h, q, kv), score + table[h, q - kv + N])


def test_python_min_max_and_floor_semantics():
    """min/max of two traced values, and // and % with Python's floor semantics on negative operands."""
    def fn(b, h, q_idx, kv_idx):
        return (max(q_idx - kv_idx, -5) // 3 + min(q_idx, kv_idx) % 4 - (kv_idx - q_idx) % -3) > (q_idx - kv_idx) // -7

    m = trace_mask_mod(fn)
    _, b, h, q, kv = grid(500)
    got = m.evaluate(b, h, q, kv)
    expected = [fn(*(int(x) for x in point)) for point in zip(b, h, q, kv)]
    assert got.tolist() == expected
    assert min(3, 4) == 3 and max([1, 7]) == 7  # the builtins are themselves again


# ----------------------------------------------------------------------------------------------- d / d score

def finite_difference(m: Modifier, score, b, h, q, kv, eps: float = 1e-2):
    s = score.double()
    up = m.evaluate(s + eps, b, h, q, kv).double()
    down = m.evaluate(s - eps, b, h, q, kv).double()
    return (up - down) / (2 * eps)


def kinked(score, b, h, q_idx, kv_idx):
    """where and maximum on the score itself: the derivative changes with the score, not only with the indices."""
    return torch.where(score > 0, score, 0.1 * score) + torch.maximum(score, torch.full_like(score, 1.0)) * 0.5


@pytest.mark.parametrize("fn", [softcap, alibi, relative_bias, leaky, kinked, t5_bias], ids=lambda f: f.__name__)
def test_grad_expr_matches_finite_differences(fn):
    m = trace_score_mod(fn)
    score, b, h, q, kv = grid(seed=5)
    keep = ((score.abs() > 0.05) & ((score - 1.0).abs() > 0.05))  # away from the kinks of `kinked`
    score, b, h, q, kv = score[keep], b[keep], h[keep], q[keep], kv[keep]
    grad = m.evaluate(score, b, h, q, kv, grad=True)
    torch.testing.assert_close(grad.double(), finite_difference(m, score, b, h, q, kv), rtol=2e-3, atol=2e-3)
    s = score.clone().requires_grad_(True)  # and torch's own autograd through the user's function
    fn(s, b, h, q, kv).sum().backward()
    torch.testing.assert_close(grad, s.grad.float(), rtol=1e-5, atol=1e-5)


def test_grad_of_a_score_free_mod_is_zero():
    m = trace_score_mod(lambda score, b, h, q_idx, kv_idx: SLOPES[h] * (kv_idx - q_idx))
    assert m.grad_expr == "0.0f"
    assert trace_score_mod(alibi).grad_expr == "1.0f"
    assert trace_score_mod(lambda s, b, h, q, kv: s * 3.0).grad_expr == "3.0f"


def test_grad_of_minimum_splits_ties_as_torch_does():
    m = trace_score_mod(lambda s, b, h, q, kv: torch.minimum(s, s * 1.0 + 0.0) + torch.maximum(s, q.float()))
    s = torch.tensor([0.0, 2.0, -3.0, 5.0], requires_grad=True)
    q = torch.tensor([0, 1, 0, 5])
    z = torch.zeros(4, dtype=torch.int64)
    (torch.minimum(s, s * 1.0 + 0.0) + torch.maximum(s, q.float())).sum().backward()
    torch.testing.assert_close(m.evaluate(s.detach(), z, z, q, z, grad=True), s.grad)


# --------------------------------------------------------------------------------------------------- errors

def test_unsupported_op_is_named():
    with pytest.raises(ModifierError, match=r"score_mod uses torch\.sin, which flashgen cannot compile; supported:"):
        trace_score_mod(lambda score, b, h, q_idx, kv_idx: torch.sin(score))
    with pytest.raises(ModifierError, match=r"Tensor\.sigmoid"):
        trace_score_mod(lambda score, b, h, q_idx, kv_idx: score.sigmoid())
    with pytest.raises(ModifierError, match=r"math\.\*"):
        trace_score_mod(lambda score, b, h, q_idx, kv_idx: math.exp(score))


def test_data_dependent_control_flow_is_refused():
    def branchy(score, b, h, q_idx, kv_idx):
        if q_idx > kv_idx:
            return score
        return score * 2

    with pytest.raises(ModifierError, match=r"control flow .*torch\.where"):
        trace_score_mod(branchy)
    with pytest.raises(ModifierError, match="control flow"):
        trace_mask_mod(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx and kv_idx >= 0)


def test_captured_tensor_indexed_by_a_float_is_refused():
    with pytest.raises(ModifierError, match=r"indexes the captured tensor 'REL' by a float expression"):
        trace_score_mod(lambda score, b, h, q_idx, kv_idx: score + REL[h, q_idx / 2])
    with pytest.raises(ModifierError, match=r"'SLOPES'.*as a value"):
        trace_score_mod(lambda score, b, h, q_idx, kv_idx: score + SLOPES)
    with pytest.raises(ModifierError, match=r"slice"):
        trace_score_mod(lambda score, b, h, q_idx, kv_idx: score + REL[h, :][q_idx])


def test_a_graph_too_large_to_write_out_is_refused_quickly():
    def doubling(score, b, h, q_idx, kv_idx):
        for _ in range(40):
            score = score + score * 0.5
        return score

    with pytest.raises(ModifierError, match="passes 200000 characters"):
        trace_score_mod(doubling)


def test_wrong_result_types_are_refused():
    with pytest.raises(ModifierError, match="mask_mod returns a int value"):
        trace_mask_mod(lambda b, h, q_idx, kv_idx: q_idx - kv_idx)
    with pytest.raises(ModifierError, match="score_mod returns a boolean"):
        trace_score_mod(lambda score, b, h, q_idx, kv_idx: score > 0)
    with pytest.raises(ModifierError, match=r"// on a float"):
        trace_score_mod(lambda score, b, h, q_idx, kv_idx: score // 2)
    with pytest.raises(ModifierError, match=r"& on non-boolean"):
        trace_mask_mod(lambda b, h, q_idx, kv_idx: (q_idx & 1) == 0)


# ---------------------------------------------------------------------------------------------------- digest

def test_digest_follows_the_graph_not_the_values():
    def make(window):
        return lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= window)

    assert trace_mask_mod(make(8)).digest == trace_mask_mod(make(8)).digest
    assert trace_mask_mod(make(8)).digest != trace_mask_mod(make(9)).digest
    assert trace_mask_mod(make(8)).source == trace_mask_mod(make(8)).source

    def biased(table):
        return lambda score, b, h, q_idx, kv_idx: score + table[h, q_idx - kv_idx + N - 1]

    first, second = trace_score_mod(biased(REL)), trace_score_mod(biased(torch.randn_like(REL)))
    assert first.digest == second.digest and first.expr == second.expr
    assert first.tensors[0] is REL and second.tensors[0] is not REL
    assert trace_score_mod(biased(REL.to(torch.float16))).digest != first.digest  # another dtype
    other_name = REL.clone()
    assert trace_score_mod(lambda s, b, h, q, kv: s + other_name[h, q - kv + N - 1]).digest == first.digest
    assert trace_mask_mod(causal).digest != trace_score_mod(lambda s, b, h, q, kv: s).digest


def test_from_cuda():
    m = Modifier.from_cuda("(q_idx >= kv_idx)", "mask")
    assert m.kind == "mask" and m.expr == "(q_idx >= kv_idx)" and m.captured == ()
    assert m.digest == Modifier.from_cuda("(q_idx >= kv_idx)", "mask").digest
    assert m.digest != Modifier.from_cuda("(q_idx > kv_idx)", "mask").digest
    with pytest.raises(ModifierError, match="no graph"):
        m.evaluate(0, 0, 0, 0)
    with pytest.raises(ModifierError, match="kind"):
        Modifier.from_cuda("score", "bias")


# ---------------------------------------------------------------------------------------------- valid CUDA

KERNEL = """
extern "C" __global__ void {name}(float* out, const float* scores, int n{params})
{{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int b = i % 2, h = (i / 2) % 4, q_idx = i / 8, kv_idx = i % 97;
    const float score = scores[i];
    (void)b; (void)h; (void)q_idx; (void)kv_idx; (void)score;
    out[i] = {value};
}}
"""


def test_reads_per_score():
    """A captured tensor read at an index of q_idx or kv_idx loads per score; one read per head does not."""
    assert trace_score_mod(relative_bias).reads_per_score and trace_mask_mod(document).reads_per_score
    assert not trace_score_mod(alibi).reads_per_score and not trace_score_mod(softcap).reads_per_score
    assert Modifier.from_cuda("score", "score").reads_per_score is False


def test_constant_on_tiles():
    """A mask that reads its indices only divided by multiples of the tile (a block-sparse table) is the same on
    every score of an aligned tile; one that reads an index otherwise is not."""
    table = torch.zeros(4, 4, dtype=torch.bool)
    by_tile = trace_mask_mod(lambda b, h, q_idx, kv_idx: table[q_idx // 256, kv_idx // 128] & (b >= 0))
    assert by_tile.constant_on_tiles(128, 128) and by_tile.constant_on_tiles(256, 64)
    assert not by_tile.constant_on_tiles(128, 256) and not by_tile.constant_on_tiles(512, 64)
    for fn in (lambda b, h, q_idx, kv_idx: table[q_idx // 128, (kv_idx + 1) // 128],
               lambda b, h, q_idx, kv_idx: table[q_idx // 128, kv_idx // 128] & (q_idx >= kv_idx),
               lambda b, h, q_idx, kv_idx: table[q_idx % 4, kv_idx // 128]):
        assert not trace_mask_mod(fn).constant_on_tiles(128, 128)
    assert not trace_mask_mod(document).constant_on_tiles(128, 128)
    assert Modifier.from_cuda("true", "mask").constant_on_tiles(128, 128) is False  # no graph: not known


def test_emitted_expressions_compile_for_sm90a(tmp_path):
    """The CUDA text of several modifiers (masks, score mods and their derivatives) builds with nvcc."""
    try:
        nvcc = fcompile.nvcc_path()
    except fcompile.CompileError:
        pytest.skip("nvcc is not installed")
    kernels = []
    half = SLOPES.to(torch.float16)

    def half_slopes(score, b, h, q_idx, kv_idx):
        return score * half[h]

    for i, fn in enumerate([document, block_sparse, softcap, t5_bias, leaky, masked_score, half_slopes]):
        m = trace_mask_mod(fn) if fn in MASKS else trace_score_mod(fn)
        params = ", " + m.params if m.captured else ""
        kernels.append(KERNEL.format(name=f"k{i}", params=params, value=f"({m.expr}) ? 1.0f : 0.0f"
                                     if m.kind == "mask" else m.expr))
        if m.grad_expr is not None:
            kernels.append(KERNEL.format(name=f"g{i}", params=params, value=m.grad_expr))
    numeric = template_env().get_template("common/numeric.cuh.j2").render(elem2_t="__half2",
                                                                           pack_fn="__floats2half2_rn")
    source = "#include <cstdint>\n#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n" + numeric + "".join(kernels)
    cu = tmp_path / "modifiers.cu"
    cu.write_text(source)
    out = subprocess.run([nvcc, "-cubin", *fcompile.arch_flags("sm_90a"), "-Werror", "all-warnings",
                          "-o", str(tmp_path / "modifiers.cubin"), str(cu)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr + source
    assert (tmp_path / "modifiers.cubin").stat().st_size > 0


# ------------------------------------------------------------------------------------------ C++ semantics on the host

def floors(b, h, q_idx, kv_idx):
    return (max(q_idx - kv_idx, -5) // 3 + min(q_idx, kv_idx) % 4 - (kv_idx - q_idx) % -3) > (q_idx - kv_idx) // -7


def masked_score(score, b, h, q_idx, kv_idx):
    return torch.where((q_idx - kv_idx) % 5 == 0, -float("inf"), score * SLOPES[h]) + (q_idx // BLOCK) / 3


HOST = """
#include <cmath>
#include <cstdio>
#include <cstring>
static float __int_as_float(int x) {{ float f; std::memcpy(&f, &x, 4); return f; }}
static float tanh_approx(float x) {{ return 1.0f - 2.0f / (1.0f + std::exp2(x * 2.8853900817779268f)); }}
{arrays}
int main() {{
    static const float scores[] = {{{scores}}};
    static const int bs[] = {{{bs}}}, hs[] = {{{hs}}}, qs[] = {{{qs}}}, kvs[] = {{{kvs}}};
    for (int i = 0; i < {n}; ++i) {{
        const float score = scores[i];
        const int b = bs[i], h = hs[i], q_idx = qs[i], kv_idx = kvs[i];
        const int qo = ((q_idx % 16) + 16) % 16, qb = q_idx - qo, ko = ((kv_idx % 37) + 37) % 37, kb = kv_idx - ko;
        (void)score; (void)b; (void)h; (void)q_idx; (void)kv_idx; (void)qb; (void)qo; (void)kb; (void)ko;
        std::printf("%.9g\\n", static_cast<double>({value}));
    }}
}}
"""


def c_list(values) -> str:
    return ", ".join(repr(float(v)) + "f" if isinstance(v, float) else str(int(v)) for v in values)


@pytest.mark.parametrize("fn", [document, block_sparse, prefix_per_batch, floors, alibi, softcap, relative_bias,
                                leaky, masked_score, overflowing, linear_distance], ids=lambda f: f.__name__)
@pytest.mark.parametrize("form", ["expr", "narrow", "split"], ids=["64-bit offsets", "32-bit offsets", "split indices"])
def test_emitted_cuda_text_computes_what_the_graph_does(fn, form, tmp_path):
    """The CUDA text, built as host C++ (float32 and integer tensors only), gives evaluate()'s numbers: floor
    division and remainder on negative operands, the casts and the precedence as written; with 32-bit offsets
    (narrow_expr) too, products past 2^32 included (overflowing); and with q_idx and kv_idx split into a base and an
    offset (split_expr), bit for bit what `expr` gives."""
    import shutil
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    m = trace_mask_mod(fn) if fn in (document, block_sparse, prefix_per_batch, floors) else trace_score_mod(fn)
    score, b, h, q, kv = grid(300, seed=7)
    q, kv = q - 30, kv - 30  # negative index arithmetic too (captured reads stay in range below)
    if m.captured:
        q, kv = q.clamp(min=0), kv.clamp(min=0)
    arrays = "".join(f"static const {c.c_type} {c.arg}[] = {{{c_list(t.flatten().tolist())}}};\n"
                     + "".join(f"static const long long {c.arg}_s{k} = {s};\n" for k, s in enumerate(c.strides))
                     for c, t in zip(m.captured, m.tensors))
    for c, t in zip(m.captured, m.tensors):
        assert t.is_contiguous() and c.dtype in ("float32", "int32", "int64", "bool")

    def host_values(value: str) -> list[str]:
        source = HOST.format(arrays=arrays, scores=c_list(score.tolist()), bs=c_list(b.tolist()),
                             hs=c_list(h.tolist()), qs=c_list(q.tolist()), kvs=c_list(kv.tolist()), n=len(score),
                             value=value)
        (tmp_path / "host.cpp").write_text(source)
        build = subprocess.run([cxx, "-O1", "-o", str(tmp_path / "host"), str(tmp_path / "host.cpp")],
                               capture_output=True, text=True, timeout=300)
        assert build.returncode == 0, build.stderr + source
        return subprocess.run([str(tmp_path / "host")], capture_output=True, text=True, timeout=60,
                              check=True).stdout.split()

    if form == "split":
        if not m.split_expr:
            assert not inputs_used(m.root) & {"q_idx", "kv_idx"}
            return
        assert host_values(m.split_expr) == host_values(m.expr)
        return
    got = torch.tensor([float(x) for x in host_values((m.narrow_expr or m.expr) if form == "narrow" else m.expr)])
    expected = (m.evaluate(score, b, h, q, kv) if m.kind == "score" else m.evaluate(b, h, q, kv)).float()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_split_form_converts_an_index_difference_once_per_row():
    """split_expr: ALiBi's kv_idx - q_idx becomes the float of the bases' difference plus that of the unrolled
    offsets (no per-score conversion of the whole index, no clamp), reads index by base + offset, and a modifier
    reading neither index has no split form."""
    m = trace_score_mod(alibi)
    assert "(static_cast<float>(kb - qb) + static_cast<float>(ko - qo))" in m.split_expr
    assert "q_idx" not in m.split_expr and "kv_idx" not in m.split_expr
    rel = trace_score_mod(relative_bias)
    assert "(static_cast<long long>(qb) + qo)" in rel.split_expr
    assert "(static_cast<long long>(kb) + ko)" in rel.split_expr
    assert trace_score_mod(softcap).split_expr == ""
    d = trace_score_mod(linear_distance)
    assert "static_cast<float>(qb - kb - 7)" in d.split_expr and "static_cast<float>(kb + 3)" in d.split_expr


def test_split_form_keeps_the_whole_conversion_where_the_index_is_not_a_unit_sum():
    """Only a ±1 combination of q_idx and kv_idx plus a small constant splits its float (exact below 2^24 for
    lengths below SPLIT_LENGTH_LIMIT); a scaled index, a large constant or a read index converts whole."""
    from flashgen.modifiers import SPLIT_CONSTANT_LIMIT, _index_affine, nodes

    def conv(fn):
        return trace_score_mod(fn).split_expr

    assert "static_cast<float>(kb + 5 - qb)" in conv(lambda s, b, h, q, kv: s + (kv - q + 5).float())
    twice = conv(lambda s, b, h, q, kv: s + (2 * kv - q).float())
    assert "static_cast<float>(kb" not in twice and "static_cast<float>((" in twice
    far = conv(lambda s, b, h, q, kv: s + (kv + SPLIT_CONSTANT_LIMIT).float())
    assert "static_cast<float>(kb" not in far
    assert all(_index_affine(n) is None for n in nodes(trace_score_mod(relative_bias).root) if n.op == "read")
