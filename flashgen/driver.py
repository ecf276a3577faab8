"""The CUDA driver API through ctypes: load cubins and launch them on any stream.

pycuda cannot wrap a stream it did not make (torch's current stream), and its packed
argument buffers break `__grid_constant__` tensor maps; `cuLaunchKernel` with a
kernelParams array does both, so every launch goes through here.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import struct
import sys
import threading
from dataclasses import dataclass

CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76


class CudaError(RuntimeError):
    """A CUDA driver call failed."""


_c = ctypes
_P = ctypes.POINTER
# (restype, argtypes) of every driver function flashgen calls (cuda.h). Without them ctypes passes each Python
# int as a C int, masked to 32 bits: a grid dimension or size past that would reach the driver as another value.
PROTOTYPES: dict[str, tuple[type, list]] = {
    "cuInit": (_c.c_int, [_c.c_uint]),
    "cuGetErrorName": (_c.c_int, [_c.c_int, _P(_c.c_char_p)]),
    "cuGetErrorString": (_c.c_int, [_c.c_int, _P(_c.c_char_p)]),
    "cuDriverGetVersion": (_c.c_int, [_P(_c.c_int)]),
    "cuDeviceGetCount": (_c.c_int, [_P(_c.c_int)]),
    "cuDeviceGet": (_c.c_int, [_P(_c.c_int), _c.c_int]),
    "cuDeviceGetName": (_c.c_int, [_c.c_char_p, _c.c_int, _c.c_int]),
    "cuDeviceGetAttribute": (_c.c_int, [_P(_c.c_int), _c.c_int, _c.c_int]),
    "cuDevicePrimaryCtxRetain": (_c.c_int, [_P(_c.c_void_p), _c.c_int]),
    "cuCtxGetCurrent": (_c.c_int, [_P(_c.c_void_p)]),
    "cuCtxSetCurrent": (_c.c_int, [_c.c_void_p]),
    "cuCtxGetDevice": (_c.c_int, [_P(_c.c_int)]),
    "cuCtxGetId": (_c.c_int, [_c.c_void_p, _P(_c.c_ulonglong)]),
    "cuCtxSynchronize": (_c.c_int, []),
    "cuPointerGetAttribute": (_c.c_int, [_c.c_void_p, _c.c_int, _c.c_ulonglong]),  # CUdeviceptr: 64-bit
    "cuMemHostAlloc": (_c.c_int, [_P(_c.c_void_p), _c.c_size_t, _c.c_uint]),
    # cuda.h maps the name to its _v2 (64-bit device pointers); the unversioned symbol refuses current contexts
    "cuMemHostGetDevicePointer_v2": (_c.c_int, [_P(_c.c_ulonglong), _c.c_void_p, _c.c_uint]),
    "cuModuleLoadData": (_c.c_int, [_P(_c.c_void_p), _c.c_char_p]),
    "cuModuleGetFunction": (_c.c_int, [_P(_c.c_void_p), _c.c_void_p, _c.c_char_p]),
    "cuFuncSetAttribute": (_c.c_int, [_c.c_void_p, _c.c_int, _c.c_int]),
    # f, grid x y z, block x y z, dynamic smem bytes, stream, kernelParams, extra
    "cuLaunchKernel": (_c.c_int, [_c.c_void_p] + [_c.c_uint] * 7 + [_c.c_void_p, _P(_c.c_void_p), _P(_c.c_void_p)]),
    # const CUlaunchConfig *, f, kernelParams, extra (Prepared calls it without the prototype: _Unchecked)
    "cuLaunchKernelEx": (_c.c_int, [_c.c_void_p, _c.c_void_p, _P(_c.c_void_p), _P(_c.c_void_p)]),
    # map, dtype, rank, base, dims, strides, box, element strides, interleave, swizzle, L2 promotion, OOB fill
    "cuTensorMapEncodeTiled": (_c.c_int, [_c.c_void_p, _c.c_int, _c.c_uint, _c.c_void_p, _P(_c.c_uint64),
                                          _P(_c.c_uint64), _P(_c.c_uint32), _P(_c.c_uint32)] + [_c.c_int] * 4),
}


def declare(cuda: ctypes.CDLL) -> ctypes.CDLL:
    """`cuda` with PROTOTYPES set on each function it has (an older driver may lack some, e.g. cuCtxGetId)."""
    for name, (restype, argtypes) in PROTOTYPES.items():
        fn = getattr(cuda, name, None)
        if fn is not None:
            fn.restype, fn.argtypes = restype, argtypes
    return cuda


@functools.lru_cache(maxsize=1)
def _bound() -> ctypes.CDLL:
    """libcuda with its prototypes declared, not yet initialized."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise CudaError(f"the CUDA driver (libcuda.so.1) is not available: {e}") from None
    return declare(cuda)


@functools.lru_cache(maxsize=1)
def lib() -> ctypes.CDLL:
    cuda = _bound()
    check(cuda.cuInit(0), "cuInit")
    return cuda


def check(rc: int, what: str) -> None:
    if rc != 0:
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        cuda = _bound()
        cuda.cuGetErrorName(rc, ctypes.byref(name))
        cuda.cuGetErrorString(rc, ctypes.byref(text))
        n = name.value.decode() if name.value else str(rc)
        t = text.value.decode() if text.value else ""
        raise CudaError(f"{what} failed: {n} ({t})")


# CUDA's launch limits (every architecture flashgen builds for).
MAX_GRID_X = 2**31 - 1
MAX_GRID_YZ = 65535
MAX_BLOCK_THREADS = 1024


def check_launch(name: str, grid: tuple[int, int, int], threads: int) -> None:
    """Raise ValueError unless `grid` (x, y, z) and a 1-d block of `threads` are within CUDA's limits: the driver
    takes 32-bit dimensions, and a larger problem must not launch a wrapped-around grid over part of its rows."""
    x, y, z = grid  # every launch passes here: plain comparisons, a few dozen nanoseconds
    if not (0 < x <= MAX_GRID_X and 0 < y <= MAX_GRID_YZ and 0 < z <= MAX_GRID_YZ and 0 < threads <= MAX_BLOCK_THREADS):
        raise ValueError(f"cannot launch {name}: grid {tuple(grid)} with {threads} threads a block is past CUDA's "
                         f"limits (grid x 1..{MAX_GRID_X}, y and z 1..{MAX_GRID_YZ}, 1..{MAX_BLOCK_THREADS} threads "
                         "a block); the problem is too large for one launch")


def current_context() -> int:
    """The current CUDA context; the primary context of device 0 is made current if none is."""
    ctx = ctypes.c_void_p()
    check(lib().cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if not ctx.value:
        return use_device(0)
    return ctx.value


@functools.lru_cache(maxsize=None)
def primary_context(device: int) -> int:
    """Device `device`'s primary context (the one torch uses), retained for the life of the process."""
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    check(lib().cuDeviceGet(ctypes.byref(dev), device), f"cuDeviceGet({device})")
    check(lib().cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    return ctx.value


def use_device(device: int) -> int:
    """Make `device`'s primary context current on this thread (only if it is not already); returns it."""
    ctx = primary_context(device)
    make_current(ctx)
    return ctx


def make_current(ctx: int, state: tuple | None = None) -> None:
    """Make context `ctx` current on this thread, only if it is not already (a launch asks on every call); `state`:
    the thread's thread_state() where the caller holds it."""
    _, _, here, ref = _tls.state if state is None else state
    rc = _unchecked(lib()).cuCtxGetCurrent(ref)
    if rc:
        check(rc, "cuCtxGetCurrent")
    if here.value != ctx:
        check(lib().cuCtxSetCurrent(ctypes.c_void_p(ctx)), "cuCtxSetCurrent")


@functools.lru_cache(maxsize=None)
def primary_context_id(device: int) -> int:
    """context_id of a primary context we retain (so it is never destroyed under us): fixed per device."""
    return context_id(primary_context(device))


def context_id(ctx: int | None = None) -> int:
    """A process-unique id of a context (cuCtxGetId): unlike its address, never reused by a later context."""
    ctx = current_context() if ctx is None else ctx
    if not hasattr(lib(), "cuCtxGetId"):  # drivers before CUDA 12.0: the address is all there is
        return ctx
    cid = ctypes.c_ulonglong()
    check(lib().cuCtxGetId(ctypes.c_void_p(ctx), ctypes.byref(cid)), "cuCtxGetId")
    return cid.value


CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9


def pointer_device(ptr: int) -> int:
    """The device ordinal that owns device memory at `ptr`."""
    dev = ctypes.c_int()
    check(lib().cuPointerGetAttribute(ctypes.byref(dev), CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr),
          "cuPointerGetAttribute(DEVICE_ORDINAL)")
    return dev.value


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    arch: str  # "sm90"
    sm_count: int


def context_device() -> int:
    """The device ordinal of the current context (device 0's primary context if none is current)."""
    current_context()
    dev = ctypes.c_int()
    check(lib().cuCtxGetDevice(ctypes.byref(dev)), "cuCtxGetDevice")
    return dev.value


def device_info(device: int | None = None) -> DeviceInfo:
    """Device `device` (an ordinal), or the device of the current context."""
    return _device_info(context_device() if device is None else device)


@functools.lru_cache(maxsize=None)
def _device_info(dev: int) -> DeviceInfo:
    def attr(a: int) -> int:
        v = ctypes.c_int()
        check(lib().cuDeviceGetAttribute(ctypes.byref(v), a, dev), "cuDeviceGetAttribute")
        return v.value

    buf = ctypes.create_string_buffer(256)
    check(lib().cuDeviceGetName(buf, 256, dev), "cuDeviceGetName")
    major, minor = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR), attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
    return DeviceInfo(buf.value.decode(), f"sm{major}{minor}", attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT))


PARAMS_MAX = 4096  # bytes: the most kernel arguments a launch may pass
_INT_MAX = 2**31 - 1


class _Thread(threading.local):
    """Per thread, as `state`: the kernel-argument buffer every launch passes, kernelParams (one pointer to that
    buffer: the driver copies the bytes during the call, so one buffer serves every launch of the thread), and the
    slot cuCtxGetCurrent writes with a reference to it. One tuple: a thread-local attribute read costs more than
    its unpacking."""

    def __init__(self) -> None:
        buf, ctx = ctypes.create_string_buffer(PARAMS_MAX), ctypes.c_void_p()
        self.state = (buf, (ctypes.c_void_p * 1)(ctypes.addressof(buf)), ctx, ctypes.byref(ctx))


_tls = _Thread()


def thread_state() -> tuple[ctypes.Array, ctypes.Array, ctypes.c_void_p, object]:
    """This thread's (argument buffer, kernelParams, context slot, its reference): write a Prepared launch's
    arguments into the buffer, then launch it with kernelParams."""
    return _tls.state


class _Unchecked:
    """cuLaunchKernelEx (cuLaunchKernel where the driver predates it) and cuCtxGetCurrent of one libcuda without
    argtypes: ctypes converts each argument by its own type instead of through a prototype's from_param, which costs
    more than the rest of a small launch's host work, as does each argument more. Callers pass pointers and handles
    as c_void_p, byref or bytes, and only ints within C int's range, which the checks before them guarantee."""

    def __init__(self, cuda: ctypes.CDLL) -> None:
        # item access: function objects apart from the declared ones
        self.ex = hasattr(cuda, "cuLaunchKernelEx")
        self.launch = cuda["cuLaunchKernelEx" if self.ex else "cuLaunchKernel"]
        self.cuCtxGetCurrent = cuda["cuCtxGetCurrent"]
        self.launch.restype = self.cuCtxGetCurrent.restype = ctypes.c_int


@functools.lru_cache(maxsize=4)
def _unchecked(cuda: ctypes.CDLL) -> _Unchecked:
    return _Unchecked(cuda)


# CUlaunchConfig (cuda.h): grid x y z, block x y z, dynamic smem bytes, (4 bytes of padding) the stream, then attrs
# and numAttrs; packed per launch around the stream's 8 bytes.
_LAUNCH_DIMS = struct.Struct("=7I4x")
_LAUNCH_ATTRS = struct.Struct("=QI4x")
_ORDER = sys.byteorder
# One CUlaunchAttribute: its id, padding to 8 bytes, a 64-byte value (for this one, an int: allowed).
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_PROGRAMMATIC = struct.pack("=I4xi60x", CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1)
_programmatic_attr = ctypes.create_string_buffer(_PROGRAMMATIC, len(_PROGRAMMATIC))  # read by the driver per launch


def _launch_attrs(programmatic: bool) -> bytes:
    """CUlaunchConfig's attrs and numAttrs: none, or programmatic stream serialization (the kernel may start while
    the stream's previous kernel runs; it waits for it with griddepcontrol.wait before touching memory)."""
    return _LAUNCH_ATTRS.pack(ctypes.addressof(_programmatic_attr), 1) if programmatic else _LAUNCH_ATTRS.pack(0, 0)


class Prepared:
    """Launches of one function with fixed dimensions, as a caller that repeats them (a plan) makes them: the
    dimensions checked against CUDA's limits once, here, and each launch made with the fewest ctypes conversions
    (_Unchecked): cuLaunchKernelEx's four pointers, its CUlaunchConfig bytes made for the stream and kept while the
    stream is the same (one (stream, bytes) pair, read and replaced whole: threads on other streams never mix them).
    Write the arguments into thread_state()'s buffer, then launch with its kernelParams. `programmatic`: with
    programmatic stream serialization, for kernels that wait for the previous grid themselves (where the driver has
    cuLaunchKernelEx; without it the launch is an ordinary one, and the kernel's wait returns at once)."""

    __slots__ = ("name", "_fn", "_launch", "_ex", "_head", "_tail", "_dims", "_config")

    def __init__(self, fn: "Function", grid: tuple[int, int, int], block: int, programmatic: bool = False) -> None:
        check_launch(fn.name, grid, block)
        if not 0 <= fn.smem_bytes <= _INT_MAX:
            raise ValueError(f"cannot launch {fn.name}: {fn.smem_bytes} bytes of shared memory")
        unchecked = _unchecked(lib())
        self.name, self._fn, self._launch, self._ex = fn.name, fn.handle, unchecked.launch, unchecked.ex
        self._head = _LAUNCH_DIMS.pack(grid[0], grid[1], grid[2], block, 1, 1, fn.smem_bytes)
        self._tail = _launch_attrs(programmatic)
        self._dims = (fn.handle, grid[0], grid[1], grid[2], block, 1, 1, fn.smem_bytes)
        self._config: tuple[int | None, bytes] = (None, b"")

    def launch(self, stream: int, kernel_params: ctypes.Array) -> None:
        if self._ex:
            config = self._config
            if config[0] != stream:
                config = self._config = (stream, self._head + stream.to_bytes(8, _ORDER) + self._tail)
            rc = self._launch(config[1], self._fn, kernel_params, None)
        else:
            rc = self._launch(*self._dims, ctypes.c_void_p(stream), kernel_params, None)
        if rc:
            check(rc, f"cuLaunchKernel({self.name}, grid={self._dims[1:4]}, block={self._dims[4]})")


class Function:
    """One loaded `__global__` function in one context."""

    def __init__(self, cubin: bytes, name: str, smem_bytes: int):
        self._module = ctypes.c_void_p()
        check(lib().cuModuleLoadData(ctypes.byref(self._module), ctypes.c_char_p(cubin)), f"cuModuleLoadData({name})")
        self.handle = ctypes.c_void_p()
        check(lib().cuModuleGetFunction(ctypes.byref(self.handle), self._module, name.encode()), f"cuModuleGetFunction({name})")
        self.name, self.smem_bytes = name, smem_bytes
        # Above 48 KB a block must opt in to its dynamic shared memory.
        check(lib().cuFuncSetAttribute(self.handle, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_bytes),
              f"cuFuncSetAttribute({name}, max dynamic smem {smem_bytes})")

    def prepared(self, grid: tuple[int, int, int], block: int, programmatic: bool = False) -> Prepared:
        """Launches of this function with `grid` and `block`, made by a caller that repeats them (Prepared)."""
        return Prepared(self, grid, block, programmatic)

    def launch(self, grid: tuple[int, int, int], block: int, params: bytes | ctypes.Structure | ctypes.Array,
               stream: int = 0, programmatic: bool = False) -> None:
        # The kernel takes one struct by value: kernelParams holds one pointer to its bytes, which
        # the driver copies during the call, so one buffer per thread serves every launch.
        raw = params if isinstance(params, bytes) else bytes(params)
        buf, args, _, _ = _tls.state
        if programmatic:  # Prepared's launch, which has the attribute (checks the dimensions too)
            buf.raw = raw
            Prepared(self, grid, block, programmatic=True).launch(stream, args)
            return
        check_launch(self.name, grid, block)
        buf.raw = raw
        rc = lib().cuLaunchKernel(self.handle, grid[0], grid[1], grid[2], block, 1, 1, self.smem_bytes,
                                  ctypes.c_void_p(stream), args, None)
        if rc:
            check(rc, f"cuLaunchKernel({self.name}, grid={grid}, block={block}, smem={self.smem_bytes})")


# Keyed by the context's unique id, not its address: a destroyed context's address can come
# back for a new one, whose modules these handles are not.
_functions: dict[tuple[int, str], Function] = {}
_lock = threading.Lock()


def get_function(cubin: bytes, name: str, smem_bytes: int, digest: str | None = None,
                 ctx_id: int | None = None) -> Function:
    """The loaded function `name` of this cubin in the current context, whose id is `ctx_id` if the
    caller knows it (loaded once per context and name: a file may hold several kernels).

    `digest` identifies the cubin (CompiledKernel.digest); hashing it on every launch would
    cost more host time than a short kernel runs."""
    key = (context_id() if ctx_id is None else ctx_id, digest or hashlib.sha1(cubin).hexdigest(), name)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    with _lock:
        fn = _functions.get(key)
        if fn is None:
            fn = _functions[key] = Function(cubin, name, smem_bytes)
    return fn


# cuTensorMapEncodeTiled enums (cuda.h)
TMA_DTYPES = {"fp16": 6, "bf16": 9, "fp8_e4m3": 0}  # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / _BFLOAT16 / _UINT8
TMA_SWIZZLE = {32: 1, 64: 2, 128: 3}  # CU_TENSOR_MAP_SWIZZLE_{32,64,128}B by row bytes
TMA_L2_PROMOTION_128B = 2


@functools.lru_cache(maxsize=4096)  # a model reuses its buffers: the same maps come back call after call
def tensor_map(dtype: str, ptr: int, dims: tuple[int, ...], strides_bytes: tuple[int, ...], box: tuple[int, ...],
               swizzle_bytes: int) -> bytes:
    """A 128-byte CUtensorMap for a tiled TMA copy; dims innermost first, strides for dims[1:]."""
    rank = len(dims)
    out = (ctypes.c_uint8 * 128)()
    rc = lib().cuTensorMapEncodeTiled(
        out, TMA_DTYPES[dtype], rank, ctypes.c_void_p(ptr),
        (ctypes.c_uint64 * rank)(*dims), (ctypes.c_uint64 * (rank - 1))(*strides_bytes),
        (ctypes.c_uint32 * rank)(*box), (ctypes.c_uint32 * rank)(*([1] * rank)),
        0, TMA_SWIZZLE[swizzle_bytes], TMA_L2_PROMOTION_128B, 0)
    check(rc, f"cuTensorMapEncodeTiled(dims={dims}, strides={strides_bytes}, box={box})")
    return bytes(out)


CU_MEMHOSTALLOC_PORTABLE = 1
CU_MEMHOSTALLOC_DEVICEMAP = 2


def host_mapped(device: int, nbytes: int) -> tuple[int, int]:
    """(host address, device address) of `nbytes` of zeroed pinned host memory that kernels on `device` read and
    write directly (cuMemHostAlloc with DEVICEMAP): the host sees their writes with a plain read, no sync. Never
    freed; callers allocate once per device."""
    use_device(device)
    host, dev = ctypes.c_void_p(), ctypes.c_ulonglong()
    check(lib().cuMemHostAlloc(ctypes.byref(host), nbytes, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP),
          f"cuMemHostAlloc({nbytes})")
    ctypes.memset(host.value, 0, nbytes)
    check(lib().cuMemHostGetDevicePointer_v2(ctypes.byref(dev), host, 0), "cuMemHostGetDevicePointer")
    return host.value, dev.value


def version() -> str:
    """The CUDA driver's version, e.g. "13.0" (what a tuning result was measured under)."""
    v = ctypes.c_int()
    check(lib().cuDriverGetVersion(ctypes.byref(v)), "cuDriverGetVersion")
    return f"{v.value // 1000}.{v.value % 1000 // 10}"


def synchronize() -> None:
    check(lib().cuCtxSynchronize(), "cuCtxSynchronize")
