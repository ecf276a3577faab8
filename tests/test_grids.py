"""Every launch grid is one formula (flashgen.grids): what the launchers evaluate in Python is what an exported
header computes in C++, and both are the rule each kernel unfolds blockIdx.x by."""
import itertools
import shutil
import subprocess

import pytest

from flashgen import grids
from flashgen.config import BwdConfig, KernelConfig

SIZES = [1, 17, 113, 1023, 4096, 2**20 + 3]


def cdiv(a, b):
    return -(-a // b)


def test_forward_grids_follow_the_tiles():
    for seqlen, heads, batch in itertools.product(SIZES, (1, 3, 32), (1, 7)):
        assert grids.FWD.bind(BLOCK_M=128)(seqlen, heads, batch) == cdiv(seqlen, 128) * heads * batch
        m = cdiv(seqlen, 64)
        assert grids.FWD_CLUSTER.bind(BLOCK_M=64)(seqlen, heads, batch) == (m + m % 2) * heads * batch
        assert grids.FWD_PACKED.bind(BLOCK_M=128)(seqlen, 32, 8, batch) == cdiv(seqlen, 128 // 4) * 8 * batch
        assert grids.FWD_VT.bind(VT_KEYS=64)(seqlen, heads, batch) == cdiv(seqlen, 64) * heads * batch
    persistent = grids.persistent(grids.FWD, cluster=True).bind(BLOCK_M=128)
    assert persistent(8192, 32, 4, 133) == 132 and persistent(1, 1, 1, 133) == 1 and persistent(4096, 1, 1, 1) == 2


def test_serving_and_backward_grids():
    serve = grids.SERVE.bind(BLOCK_M=32, PACK_GQA=True, SPLIT=True)
    assert serve(1, 32, 8, 5, 16) == cdiv(1 * 4, 32) * 8 * 5 * 16
    assert grids.SERVE.bind(BLOCK_M=64, PACK_GQA=False, SPLIT=False)(113, 8, 8, 3, 16) == cdiv(113, 64) * 8 * 3
    assert grids.COMBINE.bind(SPLIT=False, COMBINE_WARPS=4)(1000, 8) == 0
    assert grids.COMBINE.bind(SPLIT=True, COMBINE_WARPS=4)(1001, 3) == cdiv(3003, 4)
    cfg = BwdConfig(128, "bf16", False, 128, 128, 12, family="sm90")
    assert cfg.rows_grid(2, 4, 113)[0] == 128 // 64 * 8  # 64 padded rows a _pre block (four threads a row)
    assert BwdConfig(256, "bf16", False, 64, 64, 12, family="sm90").rows_grid(2, 4, 113)[0] == 128 // 32 * 8
    assert cfg.convert_grid(2, 4, 113)[0] == 128 * 128 // 4096 * 8  # two units of 64 x 32 floats a block
    assert BwdConfig(96, "bf16", False, 64, 64, 8, family="sm90").convert_grid(1, 1, 1)[0] == 2  # 3 units


def test_a_grid_past_the_launch_limit_is_refused():
    cfg = KernelConfig(128, "bf16", False, 64, 64, 4, 2)
    with pytest.raises(ValueError, match="exceed the 2147483647"):
        cfg.grid(2**16, 2**10, 2**20)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_cpp_computes_what_python_computes(tmp_path):
    consts = {"BLOCK_M": 64, "BLOCK_N": 128, "ROW_WARPS": 8, "PRE_ROWS": 32, "HEAD_DIM": 96, "PACK_GQA": True, "SPLIT": True,
              "COMBINE_WARPS": 4, "VT_KEYS": 64}
    formulas = {"fwd": grids.FWD, "cluster": grids.FWD_CLUSTER, "packed": grids.FWD_PACKED,
                "pfwd": grids.persistent(grids.FWD), "pcluster": grids.persistent(grids.FWD_CLUSTER, True),
                "serve": grids.SERVE, "combine": grids.COMBINE, "bmain": grids.BWD_MAIN, "bdq": grids.BWD_DQ,
                "brows": grids.BWD_ROWS, "srows": grids.SM90_BWD_ROWS, "sconv": grids.SM90_BWD_CONVERT,
                "vt": grids.FWD_VT}
    values = {"seqlen_q": 1023, "seqlen_k": 4097, "heads": 32, "heads_k": 8, "batch": 3, "num_splits": 7,
              "total_rows": 3069, "sm_count": 133}
    decls = "\n".join(f"constexpr {'bool' if isinstance(v, bool) else 'int'} {k} = {str(v).lower()};"
                      for k, v in consts.items())
    body = "\n".join(f.cpp(f"g_{n}") for n, f in formulas.items())
    calls = "\n".join(f'    printf("%u\\n", g_{n}({", ".join(str(values[a]) for a in f.args)}));'
                      for n, f in formulas.items())
    (tmp_path / "g.cpp").write_text(f"#include <cstdio>\n#include <stdint.h>\n{decls}\n{grids.CPP_HELPERS}\n{body}\n"
                                    f"int main() {{\n{calls}\n}}\n")
    subprocess.run(["nvcc", "-x", "cu", "-o", str(tmp_path / "g"), str(tmp_path / "g.cpp")], check=True,
                   capture_output=True)
    got = [int(x) for x in subprocess.run([str(tmp_path / "g")], capture_output=True, text=True).stdout.split()]
    want = [f.bind(**consts)(*(values[a] for a in f.args)) for f in formulas.values()]
    assert got == want
