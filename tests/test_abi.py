"""The argument structs, described once in flashgen.abi: their layout as nvcc lays them out, the packers the
launchers use, and the pointer positions they fill."""
import shutil
import struct
import subprocess

import pytest

from flashgen import abi


def test_layouts_are_the_c_layouts():
    # Sizes and offsets a kernel reads, by C's rules (CUtensorMap aligned to 128 bytes).
    assert (abi.FWD.size, abi.SERVE.size, abi.BWD.size, abi.BWD_SERVE.size) == (168, 320, 328, 384)
    assert (abi.SM90_FWD.size, abi.SM90_SERVE_FWD.size, abi.SM90_FP8_FWD.size, abi.SM90_BWD.size) == (640, 640, 640, 1024)
    assert abi.SM90_FWD.offset("p.q") == 384 and abi.SM90_BWD.offset("p.q") == 512
    assert abi.SM90_SERVE_FWD.offset("cu_seqlens_q") == 552
    assert abi.SM90_BWD.offset("cu_seqlens_q") == 856 and abi.SM90_BWD.offset("max_seqlen_k") == 888
    assert abi.SM90_BWD.offset("dq_semaphore") == 896  # appended: the fields before it stay where they were
    assert abi.SM90_FP8_FWD.offset("q_descale.ptr") == 552 and abi.SM90_FP8_FWD.offset("v_descale.head_stride") == 616


def test_packers_match_their_size():
    for block in abi.BLOCKS.values():
        assert block.struct.size == block.size, block.name
        assert block.tail(block.fields[0].path).size == block.size


def test_tail_packs_from_a_field_to_the_end():
    tail = abi.SM90_SERVE_FWD.tail("cu_seqlens_q")
    assert abi.SM90_SERVE_FWD.offset("cu_seqlens_q") + tail.size == abi.SM90_SERVE_FWD.size
    assert abi.BWD_SERVE.tail("cu_seqlens_q").format == "=3Qq2if3i"


def test_pointer_positions():
    # q k v o lse, then the serving pointers: what a serving launch fills per call.
    assert abi.SERVE.pointers == (0, 1, 2, 3, 4, 24, 25, 26, 27, 28, 29, 30, 45, 46, 47)
    assert [abi.SERVE.fields[i].path for i in abi.SERVE.pointers[5:]] == [
        "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "block_table", "alibi_slopes", "o_accum", "lse_accum", "error",
        "sinks", "tile_counts"]
    assert abi.BWD.pointers == tuple(range(13))


def test_serve_bounds_follow_the_older_fields():
    # The bounds and the error word come after every earlier field, whose offsets stay where they were.
    assert abi.SERVE.offset("softcap_pre") == 276
    assert [abi.SERVE.offset(f) for f in ("num_pages", "k_capacity", "total_q", "total_k", "error")] == [
        280, 284, 288, 292, 296]
    assert abi.SERVE.offset("sinks") == 304 and abi.SM90_SERVE_FWD.offset("sinks") == 592  # last: nothing moved
    assert abi.SERVE.offset("tile_counts") == 312 and abi.SERVE.size == 320 and abi.SERVE.fields[-1].kind == "ptr"
    assert abi.SERVE_INPUTS == ("block_table", "cache_seqlens", "cu_seqlens_q", "cu_seqlens_k")


def test_whole_block_packs_by_position():
    values = [0] * len(abi.FWD.fields)
    values[abi.FWD.index("batch")] = 7
    values[abi.FWD.index("scale_log2")] = 1.5
    raw = abi.FWD.struct.pack(*values)
    assert struct.unpack_from("=i", raw, abi.FWD.offset("batch")) == (7,)
    assert struct.unpack_from("=f", raw, abi.FWD.offset("scale_log2")) == (1.5,)


def test_an_unknown_type_is_refused():
    bad = abi.Block("Bad", "BAD", (), (abi.Line("double", ("x",)),))
    with pytest.raises(KeyError):
        bad.fields


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_nvcc_agrees_with_every_layout(tmp_path):
    """The generated declarations carry static_asserts of their size and offsets: nvcc must accept them."""
    order = ["FwdParams", "ServeParams", "ModTensor", "ServeModParams", "BwdParams", "BwdServeParams", "Sm90FwdParams", "Sm90ServeFwdParams",
             "Fp8Descale", "Sm90Fp8FwdParams", "Sm90BwdParams"]
    src = tmp_path / "abi.cu"
    src.write_text("#include <cuda.h>\n#include <stdint.h>\n" + "\n".join(abi.BLOCKS[n].cpp() for n in order) + "\n")
    out = subprocess.run(["nvcc", "-std=c++17", "-c", str(src), "-o", str(tmp_path / "abi.o")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    # and the check can fail: a wrong size is refused
    src.write_text(src.read_text().replace("sizeof(FwdParams) == 168", "sizeof(FwdParams) == 160"))
    out = subprocess.run(["nvcc", "-std=c++17", "-c", str(src), "-o", str(tmp_path / "abi.o")],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "FwdParams disagrees" in out.stderr
