"""The CUDA driver API through ctypes: load cubins and launch them on any stream.

pycuda cannot wrap a stream it did not make (torch's current stream), and its packed
argument buffers break `__grid_constant__` tensor maps; `cuLaunchKernel` with a
kernelParams array does both, so every launch goes through here.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import threading
from dataclasses import dataclass

CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76


class CudaError(RuntimeError):
    """A CUDA driver call failed."""


@functools.lru_cache(maxsize=1)
def lib() -> ctypes.CDLL:
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise CudaError(f"the CUDA driver (libcuda.so.1) is not available: {e}") from None
    check(cuda.cuInit(0), "cuInit")
    return cuda


def check(rc: int, what: str) -> None:
    if rc != 0:
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        cuda = ctypes.CDLL("libcuda.so.1")
        cuda.cuGetErrorName(rc, ctypes.byref(name))
        cuda.cuGetErrorString(rc, ctypes.byref(text))
        n = name.value.decode() if name.value else str(rc)
        t = text.value.decode() if text.value else ""
        raise CudaError(f"{what} failed: {n} ({t})")


def current_context() -> int:
    """The current CUDA context; the primary context of device 0 is made current if none is."""
    ctx = ctypes.c_void_p()
    check(lib().cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if not ctx.value:
        dev = ctypes.c_int()
        check(lib().cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
        check(lib().cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        check(lib().cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return ctx.value


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    arch: str  # "sm90"
    sm_count: int


def device_info() -> DeviceInfo:
    """The device of the current context."""
    current_context()
    dev = ctypes.c_int()
    check(lib().cuCtxGetDevice(ctypes.byref(dev)), "cuCtxGetDevice")
    return _device_info(dev.value)


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

    def launch(self, grid: tuple[int, int, int], block: int, params: ctypes.Structure | ctypes.Array, stream: int = 0) -> None:
        # The kernel takes one struct by value: kernelParams holds one pointer to its bytes.
        args = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(params), ctypes.c_void_p))
        rc = lib().cuLaunchKernel(self.handle, grid[0], grid[1], grid[2], block, 1, 1, self.smem_bytes,
                                  ctypes.c_void_p(stream), args, None)
        check(rc, f"cuLaunchKernel({self.name}, grid={grid}, block={block}, smem={self.smem_bytes})")


_functions: dict[tuple[int, str], Function] = {}
_lock = threading.Lock()


def get_function(cubin: bytes, name: str, smem_bytes: int, digest: str | None = None) -> Function:
    """The loaded function for this cubin in the current context (loaded once per context).

    `digest` identifies the cubin (CompiledKernel.digest); hashing it on every launch would
    cost more host time than a short kernel runs."""
    key = (current_context(), digest or hashlib.sha1(cubin).hexdigest())
    with _lock:
        fn = _functions.get(key)
        if fn is None:
            fn = _functions[key] = Function(cubin, name, smem_bytes)
    return fn


# cuTensorMapEncodeTiled enums (cuda.h)
TMA_DTYPES = {"fp16": 6, "bf16": 9}  # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / _BFLOAT16
TMA_SWIZZLE = {32: 1, 64: 2, 128: 3}  # CU_TENSOR_MAP_SWIZZLE_{32,64,128}B by row bytes
TMA_L2_PROMOTION_128B = 2


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


def synchronize() -> None:
    check(lib().cuCtxSynchronize(), "cuCtxSynchronize")
