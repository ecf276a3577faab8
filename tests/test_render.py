import itertools
import re

from flashgen.config import HALF_DTYPES, HEAD_DIMS, KernelConfig, space
from flashgen.render import render


def test_every_config_of_the_space_renders():
    n = 0
    for hd, dt, causal in itertools.product(HEAD_DIMS, HALF_DTYPES, (False, True)):
        for c in space("sm80", hd, dt, causal):
            src = render(c)
            assert src.startswith(f"// {c.name}\n")
            assert f'extern "C" __global__ void __launch_bounds__({c.threads}) {c.name}(' in src
            assert f"constexpr int BLOCK_N = {c.block_n};" in src
            assert "{{" not in src and "{%" not in src  # nothing left unrendered
            n += 1
    assert n > 1000


def test_rendered_source_states_its_configuration():
    c = KernelConfig(96, "fp16", True, 64, 32, 2, 3)
    src = render(c)
    header = src.splitlines()[2]
    assert header == "// head_dim=96 dtype=fp16 causal=true block_m=64 block_n=32 num_warps=2 num_stages=3"
    assert "using elem_t = __half;" in src and "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in src
    assert "constexpr bool IS_CAUSAL = true;" in src


def test_dtype_selects_instruction_types():
    src = render(KernelConfig(64, "bf16", False, 128, 64, 4, 2))
    assert "using elem_t = __nv_bfloat16;" in src and ".f32.bf16.bf16.f32" in src
    assert "__floats2bfloat162_rn" in src
    assert re.search(r"static_assert\(SMEM_BYTES == \d+", src)
