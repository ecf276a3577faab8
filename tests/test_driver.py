"""The ctypes driver layer without a GPU: prototypes on every driver function flashgen calls, and launch
dimensions checked against CUDA's limits before the driver sees them (a C stub stands in for libcuda)."""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from flashgen import driver

ROOT = Path(__file__).resolve().parent.parent

# A libcuda stand-in: the calls Function makes, recording the launch's dimensions as the C ABI delivers them.
STUB_C = r"""
#include <stdlib.h>
#include <string.h>
typedef struct {
    unsigned gx, gy, gz, bx, by, bz, smem; int launches; unsigned long long stream; unsigned char params[8]; int ex;
    unsigned n_attrs, attr_id; int attr_value;
} Last;
static Last last;
static void *current;
int cuCtxGetCurrent(void **c) { *c = current; return 0; }
int cuCtxSetCurrent(void *c) { current = c; return 0; }
#ifndef NO_EX
typedef struct { unsigned id; char pad[4]; int value; char rest[60]; } Attr;
typedef struct { unsigned gx, gy, gz, bx, by, bz, smem; void *stream; const Attr *attrs; unsigned n_attrs; } Config;
int cuLaunchKernelEx(const Config *c, void *f, void **params, void **extra) {
    if ((c->n_attrs && !c->attrs) || (!c->n_attrs && c->attrs) || c->n_attrs > 1 || extra) return 1;
    last.n_attrs = c->n_attrs; last.attr_id = c->n_attrs ? c->attrs[0].id : 0;
    last.attr_value = c->n_attrs ? c->attrs[0].value : 0;
    last.gx = c->gx; last.gy = c->gy; last.gz = c->gz; last.bx = c->bx; last.by = c->by; last.bz = c->bz;
    last.smem = c->smem; last.stream = (unsigned long long)c->stream; memcpy(last.params, params[0], 8);
    last.launches++; last.ex = 1;
    return 0;
}
#endif
int cuInit(unsigned flags) { return 0; }
int cuGetErrorName(int rc, const char **s) { *s = "CUDA_ERROR_STUB"; return 0; }
int cuGetErrorString(int rc, const char **s) { *s = "stub"; return 0; }
int cuModuleLoadData(void **m, const void *image) { *m = (void *)0x10; return 0; }
int cuModuleGetFunction(void **f, void *m, const char *name) { *f = (void *)0x20; return 0; }
int cuFuncSetAttribute(void *f, int attr, int value) { return 0; }
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned smem, void *stream, void **params, void **extra) {
    last.gx = gx; last.gy = gy; last.gz = gz; last.bx = bx; last.by = by; last.bz = bz; last.smem = smem;
    last.stream = (unsigned long long)stream; memcpy(last.params, params[0], 8);
    last.launches++; last.ex = 0; last.n_attrs = 0;
    return 0;
}
int cuMemHostAlloc(void **p, size_t n, unsigned flags) { *p = calloc(1, n); return 0; }
int cuMemHostGetDevicePointer_v2(unsigned long long *d, void *p, unsigned flags) { *d = (unsigned long long)p; return 0; }
void stub_last(Last *out) { *out = last; }
"""


class Last(ctypes.Structure):
    _fields_ = ([(n, ctypes.c_uint) for n in ("gx", "gy", "gz", "bx", "by", "bz", "smem")] +
                [("launches", ctypes.c_int), ("stream", ctypes.c_ulonglong), ("params", ctypes.c_ubyte * 8),
                 ("ex", ctypes.c_int), ("n_attrs", ctypes.c_uint), ("attr_id", ctypes.c_uint),
                 ("attr_value", ctypes.c_int)])


@pytest.fixture(params=["ex", "no-ex"])
def stub(tmp_path, monkeypatch, request):
    """driver.lib() answering with the C stub, its prototypes declared as for libcuda; a driver with
    cuLaunchKernelEx and one without it (before CUDA 12.0)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the stub driver")
    src, so = tmp_path / "stub.c", tmp_path / "libcudastub.so"
    src.write_text(STUB_C)
    flags = ["-DNO_EX"] if request.param == "no-ex" else []
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(so), str(src), *flags], check=True)
    cuda = driver.declare(ctypes.CDLL(str(so)))
    monkeypatch.setattr(driver, "lib", lambda: cuda)
    monkeypatch.setattr(driver, "_bound", lambda: cuda)

    def last() -> Last:
        out = Last()
        cuda.stub_last(ctypes.byref(out))
        return out

    return last


def test_every_driver_function_flashgen_calls_has_a_prototype():
    """Without argtypes ctypes passes each Python int as a C int and masks it to 32 bits: a 64-bit pointer or an
    out-of-range size reaches the driver as another value. Every cu* call in the package must be declared."""
    called = set()
    for f in (ROOT / "flashgen").rglob("*.py"):
        called |= set(re.findall(r"\b(cu[A-Z]\w+)\(", f.read_text()))
    assert {"cuLaunchKernel", "cuTensorMapEncodeTiled", "cuModuleLoadData"} <= called
    assert called <= set(driver.PROTOTYPES), sorted(called - set(driver.PROTOTYPES))
    for name, (restype, argtypes) in driver.PROTOTYPES.items():
        assert restype is ctypes.c_int and isinstance(argtypes, list), name


def test_declare_sets_argtypes_and_restype(stub):
    cuda = driver.lib()
    assert cuda.cuLaunchKernel.argtypes == driver.PROTOTYPES["cuLaunchKernel"][1]
    assert cuda.cuLaunchKernel.restype is ctypes.c_int
    assert len(cuda.cuLaunchKernel.argtypes) == 11


def test_the_largest_legal_grid_reaches_the_driver_intact(stub):
    fn = driver.Function(b"cubin", "k", 1 << 17)
    fn.launch((2**31 - 1, 65535, 65535), 1024, b"\0" * 8, stream=0)
    last = stub()
    assert (last.gx, last.gy, last.gz, last.bx, last.by, last.bz, last.smem) == (2**31 - 1, 65535, 65535, 1024, 1, 1,
                                                                                 1 << 17)


@pytest.mark.parametrize("grid, block", [
    ((2**32 + 7, 1, 1), 128),  # masked to 32 bits this would launch 7 blocks
    ((2**31, 1, 1), 128),
    ((1, 65536, 1), 128),
    ((1, 1, 65536), 128),
    ((0, 1, 1), 128),
    ((-1, 1, 1), 128),
    ((1, 1, 1), 1025),
    ((1, 1, 1), 0),
])
def test_a_grid_past_cudas_limits_is_refused_naming_the_kernel(stub, grid, block):
    fn = driver.Function(b"cubin", "flash_fwd_kernel_x", 0)
    with pytest.raises(ValueError, match=r"flash_fwd_kernel_x.*grid") as e:
        fn.launch(grid, block, b"\0" * 8)
    assert str(grid) in str(e.value)
    assert stub().launches == 0  # nothing reached the driver


def test_a_varlen_batch_too_large_for_one_grid_is_refused_before_the_driver(stub, monkeypatch):
    """max_seqlen_q = 2^31 - 1 over 4,097 one-token sequences: the sm80 serving kernel's grid is past 2^31 - 1
    blocks (masked to 32 bits it launched 2^30 blocks over a fraction of the rows)."""
    torch = pytest.importorskip("torch")
    from flashgen.kernels import serving

    fn = driver.Function(b"cubin", "serve_main", 0)
    monkeypatch.setattr(serving, "_functions", lambda cfg, arch, ctx: (fn, None))
    monkeypatch.setattr(serving, "arch_and_slots", lambda device: ("sm80", 108))
    monkeypatch.setattr(serving.driver, "use_device", lambda device: None)
    monkeypatch.setattr(serving.driver, "primary_context_id", lambda device: 1)
    monkeypatch.setattr(serving, "current_stream", lambda device: 0)
    n = 4097
    q = torch.zeros(n, 8, 128, dtype=torch.bfloat16)
    cu = torch.arange(n + 1, dtype=torch.int32)
    cfg = serving.serve_config(128, "bf16", False, 2**31 - 1, "sm80", varlen=True)
    blocks = serving.serve_grids(cfg, n, 8, 8, 2**31 - 1, n, 1)[0]
    assert blocks > 2**31 - 1
    with pytest.raises(ValueError, match=r"serve_main.*grid"):
        serving.launch_prefill(cfg, q, q, q, torch.empty_like(q), None, cu_q=cu, cu_k=cu, max_seqlen_q=2**31 - 1,
                               max_seqlen_k=1, num_splits=1, mods=serving.Mods(), softmax_scale=None)
    assert stub().launches == 0


def test_a_prepared_launch_reaches_the_driver_intact(stub):
    """driver.Prepared (a plan's launches, without ctypes prototypes): the largest legal grid, the block, the shared
    memory, a 64-bit stream handle and the thread's argument buffer reach the driver as given, through
    cuLaunchKernelEx or, where the driver lacks it, cuLaunchKernel."""
    fn = driver.Function(b"cubin", "k", 1 << 17)
    run = fn.prepared((2**31 - 1, 65535, 65535), 1024)
    buf, params, _, _ = driver.thread_state()
    buf.raw = b"planned!"
    run.launch(0x7F12_3456_789A, params)
    last = stub()
    assert (last.gx, last.gy, last.gz, last.bx, last.by, last.bz, last.smem) == (2**31 - 1, 65535, 65535, 1024, 1, 1,
                                                                                 1 << 17)
    assert last.stream == 0x7F12_3456_789A and bytes(last.params) == b"planned!" and last.launches == 1
    assert last.ex == hasattr(driver.lib(), "cuLaunchKernelEx")
    run.launch(0, params)
    assert stub().stream == 0 and stub().launches == 2
    run.launch(0x7F12_3456_789A, params)  # a stream again after another: its own configuration
    assert stub().stream == 0x7F12_3456_789A and stub().launches == 3


def test_a_programmatic_launch_carries_the_attribute_and_an_ordinary_one_none(stub):
    """The split-KV kernels wait for the grid before them themselves (griddepcontrol.wait), so they launch with
    programmatic stream serialization: one CUlaunchAttribute, id 6, value 1, through cuLaunchKernelEx, prepared or
    not; a launch of any other kernel carries none (its blocks must not start before the grid before it ends); a
    driver without cuLaunchKernelEx launches it as an ordinary kernel."""
    fn = driver.Function(b"cubin", "k", 0)
    buf, params, _, _ = driver.thread_state()
    ex = hasattr(driver.lib(), "cuLaunchKernelEx")
    fn.prepared((4, 1, 1), 128, programmatic=True).launch(7, params)
    assert (stub().n_attrs, stub().attr_id, stub().attr_value) == ((1, 6, 1) if ex else (0, 0, 0))
    fn.prepared((4, 1, 1), 128).launch(7, params)
    assert stub().n_attrs == 0 and stub().launches == 2
    fn.launch((3, 1, 1), 64, b"unplanned", stream=9, programmatic=True)
    last = stub()
    assert (last.n_attrs, last.attr_id, last.attr_value) == ((1, 6, 1) if ex else (0, 0, 0))
    assert (last.gx, last.bx, last.stream, bytes(last.params)) == (3, 64, 9, b"unplanne") and last.launches == 3
    fn.launch((3, 1, 1), 64, b"ordinary", stream=9)
    assert stub().n_attrs == 0 and stub().launches == 4


@pytest.mark.parametrize("grid, block", [((2**31, 1, 1), 128), ((1, 65536, 1), 128), ((0, 1, 1), 128),
                                         ((1, 1, 1), 1025)])
def test_a_prepared_launch_past_cudas_limits_is_refused_when_made(stub, grid, block):
    fn = driver.Function(b"cubin", "serve_main", 0)
    with pytest.raises(ValueError, match=r"serve_main.*grid"):
        fn.prepared(grid, block)
    assert stub().launches == 0


def test_make_current_leaves_the_context_current(stub):
    driver.make_current(0x1000)
    here = ctypes.c_void_p()
    driver.lib().cuCtxGetCurrent(ctypes.byref(here))
    assert here.value == 0x1000
    driver.make_current(0x1000)
    driver.make_current(0x2000)
    driver.lib().cuCtxGetCurrent(ctypes.byref(here))
    assert here.value == 0x2000
