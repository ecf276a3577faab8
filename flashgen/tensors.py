"""A uniform view of torch tensors and `__cuda_array_interface__` arrays (flashgen.checks checks them)."""
from __future__ import annotations

from typing import Any, NamedTuple

from .config import elem_bytes

TORCH_DTYPES = {"torch.float16": "fp16", "torch.bfloat16": "bf16", "torch.float8_e4m3fn": "fp8_e4m3"}
_CAI_DTYPES = {"<f2": "fp16", "float16": "fp16", "bfloat16": "bf16"}
_torch_dtypes: dict[Any, str] = {}  # torch.dtype -> name, filled on first use (torch stays optional)
_TORCH_NAMES = {name: t.split(".")[1] for t, name in TORCH_DTYPES.items()} | {"fp32": "float32"}


def torch_dtype(name: str) -> Any:
    """The torch dtype of a flashgen dtype name ("fp16", "bf16", "fp8_e4m3", "fp32"); imports torch."""
    import torch  # noqa: PLC0415

    return getattr(torch, _TORCH_NAMES[name])


class View(NamedTuple):  # a NamedTuple: made three times per call, where a frozen dataclass costs microseconds
    """What a kernel launch needs from one tensor; strides are in elements."""

    obj: Any
    kind: str  # "torch" or "cai"
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str  # "fp16" / "bf16" / "fp8_e4m3"
    device: int  # torch device index; -1 for a GPU array (the current context's device)


def is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "data_ptr")


def view(x: Any, name: str) -> View:
    if is_torch(x):
        if not x.is_cuda:
            raise ValueError(f"{name} is on {x.device}; flashgen runs on CUDA tensors (move it with .cuda())")
        dtype = _torch_dtypes.get(x.dtype)
        if dtype is None:
            dtype = _torch_dtypes[x.dtype] = TORCH_DTYPES.get(str(x.dtype))
            if dtype is None:
                del _torch_dtypes[x.dtype]
                raise TypeError(f"{name} has dtype {x.dtype}; supported: torch.float16, torch.bfloat16, "
                                "torch.float8_e4m3fn (sm90, with descale factors)")
        return View(x, "torch", x.data_ptr(), tuple(x.shape), x.stride(), dtype, x.get_device())
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is None:
        raise TypeError(
            f"{name} is a {type(x).__name__}; pass a torch CUDA tensor or a GPU array with __cuda_array_interface__ "
            "(e.g. pycuda GPUArray)"
        )
    typestr = cai["typestr"]
    dt = getattr(x, "dtype", None)
    dtype = _CAI_DTYPES.get(typestr) or _CAI_DTYPES.get(str(dt))
    if dtype is None:
        raise TypeError(f"{name} has dtype {dt or typestr}; supported: float16, bfloat16")
    shape = tuple(cai["shape"])
    if cai.get("strides") is None:  # C-contiguous
        strides, acc = [], 1
        for n in reversed(shape):
            strides.append(acc)
            acc *= n
        strides = tuple(reversed(strides))
    else:
        strides = tuple(s // 2 for s in cai["strides"])
    # A GPU array lives in the current context's device.
    return View(x, "cai", int(cai["data"][0]), shape, strides, dtype, -1)


class Problem(NamedTuple):
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    heads_k: int
    head_dim: int
    dtype: str
    head_dim_v: int | None = None  # v's and o's, where it is not head_dim (a split-width kernel's)

    @property
    def v_dim(self) -> int:
        """The head dim of v and o."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v


def align_elems(dtype: str) -> int:
    """Elements in 16 bytes: strides must be multiples of it (8 for fp16/bf16, 16 for FP8)."""
    return 16 // elem_bytes(dtype)


def aligned_strides(t: View) -> bool:
    """Row, head and batch strides that keep 16-byte loads aligned (multiples of 16 bytes)."""
    s, n = t.strides, align_elems(t.dtype)
    return s[0] % n == 0 and s[1] % n == 0 and s[2] % n == 0


def aligned(t: View) -> bool:
    """16-byte loads need a 16-byte aligned base and row strides that are multiples of 16 bytes."""
    return t.ptr % 16 == 0 and aligned_strides(t)
