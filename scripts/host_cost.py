"""The host cost of a decode call, on a CPU: the public call path with the CUDA driver stubbed.

    python scripts/host_cost.py [--calls 20000] [--top 25] [--point b1x8k] [--no-profile]
    python scripts/host_cost.py --modifier document --modifier causal [--stages]

Times N back-to-back calls of flashgen.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens) and of
flashgen.attention(q, k, v) (one query token: the same decode plan) with time.perf_counter_ns, and prints
microseconds per call and a cProfile top list (cumulative and own time). --modifier CASE: instead, a dense call
with one of `bench --kind flex`'s cases (4 x 4096 tokens, 16 heads, d128, bf16; forward, and forward with autograd)
beside the plain call's forward. --stages: the inclusive time per call of each step of that path, each wrapped in a timer (no
profiler, whose own cost per Python call distorts the split).

Every Python line of a real call runs; what stands in for the GPU:
  * libcuda is a C stub (compiled here with cc; its cuLaunchKernel records a count and returns): the ctypes
    marshalling of every driver call is real, the driver's own work (~2-4 us per cuLaunchKernel) is not counted;
  * the tensors are CPU tensors that say is_cuda=True and get_device()=0 (Python attributes on torch.Tensor in
    place of torch's C ones, a few tens of nanoseconds dearer per read); torch's CPU allocator stands in for the
    CUDA caching allocator (a CUDA torch.empty costs ~1-3 us more than a CPU one);
  * torch's current raw stream is the builtin `abs` (stream 0 of device 0), whether a capture runs is the builtin
    `bool` (False): the same cost class as torch's C builtins behind them;
  * kernels are not compiled: the plan's functions are driver.Function objects over the stub's module (a modifier
    call's kernel is, once, where the schedule rule asks ptxas whether it builds clean: FLASHGEN_CACHE_DIR keeps it);
  * --modifier: tensors also say device cuda:0 (a property on torch.Tensor), and the block map is built on the CPU
    with the real property (once: it is cached).
So a figure here is what the host spends in flashgen, torch's tensor attributes and allocation on a CPU, and
ctypes; a real call adds the driver's launch time and the CUDA allocator's, and runs on the GPU host's CPU.
"""
from __future__ import annotations

import argparse
import cProfile
import contextlib
import ctypes
import functools
import io
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# A libcuda stand-in answering every call a decode step makes: an H200 (sm90, 132 SMs) whose context and
# modules are fixed addresses, launches counted.
STUB_C = r"""
#include <stdlib.h>
#include <string.h>
static void *current;
static long launches;
int cuInit(unsigned flags) { return 0; }
int cuGetErrorName(int rc, const char **s) { *s = "CUDA_ERROR_STUB"; return 0; }
int cuGetErrorString(int rc, const char **s) { *s = "stub"; return 0; }
int cuDriverGetVersion(int *v) { *v = 13000; return 0; }
int cuDeviceGetCount(int *n) { *n = 1; return 0; }
int cuDeviceGet(int *d, int ordinal) { *d = ordinal; return 0; }
int cuDeviceGetName(char *name, int len, int dev) { strncpy(name, "NVIDIA H200", len); return 0; }
int cuDeviceGetAttribute(int *v, int attr, int dev) { *v = attr == 16 ? 132 : attr == 75 ? 9 : 0; return 0; }
int cuDevicePrimaryCtxRetain(void **ctx, int dev) { *ctx = (void *)0x1000; return 0; }
int cuCtxGetCurrent(void **ctx) { *ctx = current; return 0; }
int cuCtxSetCurrent(void *ctx) { current = ctx; return 0; }
int cuCtxGetDevice(int *d) { *d = 0; return 0; }
int cuCtxGetId(void *ctx, unsigned long long *id) { *id = 1; return 0; }
int cuCtxSynchronize(void) { return 0; }
int cuModuleLoadData(void **m, const void *image) { *m = (void *)0x10; return 0; }
int cuModuleGetFunction(void **f, void *m, const char *name) { *f = (void *)0x20; return 0; }
int cuFuncSetAttribute(void *f, int attr, int value) { return 0; }
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned smem, void *stream, void **params, void **extra) { launches++; return 0; }
int cuLaunchKernelEx(const void *config, void *f, void **params, void **extra) { launches++; return 0; }
int cuMemHostAlloc(void **p, size_t n, unsigned flags) { *p = calloc(1, n); return 0; }
int cuMemHostGetDevicePointer_v2(unsigned long long *d, void *p, unsigned flags) {
    *d = (unsigned long long)p; return 0;
}
int cuTensorMapEncodeTiled(void *map, int dtype, unsigned rank, void *base, const void *dims, const void *strides,
                           const void *box, const void *elem_strides, int interleave, int swizzle, int l2, int oob) {
    return 0;
}
long stub_launches(void) { return launches; }
#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
/* --instructions: count only between stub_count(1) and stub_count(0), one dump per region */
void stub_count(int on) { if (on) { CALLGRIND_ZERO_STATS; CALLGRIND_TOGGLE_COLLECT; }
                          else { CALLGRIND_TOGGLE_COLLECT; CALLGRIND_DUMP_STATS; } }
#else
void stub_count(int on) {}
#endif
"""

POINTS = {"b1x8k": (1, 8192), "b32x8k": (32, 8192), "b1x128k": (1, 131072)}
HEADS, HEADS_K, HEAD_DIM = 32, 8, 128


def stub_cuda() -> ctypes.CDLL:
    """Point flashgen's driver layer and torch's CUDA queries at the stand-ins the module docstring lists."""
    import torch

    from flashgen import driver, launch, resolve
    from flashgen.kernels import serving

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("host_cost.py needs a C compiler (cc) for its libcuda stub")
    tmp = Path(tempfile.mkdtemp(prefix="flashgen-host-cost-"))
    (tmp / "stub.c").write_text(STUB_C)
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(tmp / "libcuda.so"), str(tmp / "stub.c")], check=True)
    cuda = driver.declare(ctypes.CDLL(str(tmp / "libcuda.so")))
    cuda.stub_launches.restype = ctypes.c_long
    driver._bound = functools.lru_cache(maxsize=1)(lambda: cuda)  # as cached as the real ones
    driver.lib = functools.lru_cache(maxsize=1)(lambda: cuda)

    torch.Tensor.is_cuda = property(lambda self: True)
    torch.Tensor.get_device = lambda self: 0
    torch._C._cuda_getCurrentRawStream = abs  # device 0 -> stream 0
    torch._C._cuda_isCurrentStreamCapturing = torch.cuda.graphs._cuda_isCurrentStreamCapturing = bool  # False
    launch._capture_check = functools.lru_cache(maxsize=1)(lambda: bool)  # what it returns where CUDA is there

    def functions(cfg: Any, arch: str, ctx: int) -> tuple[Any, Any]:  # the stub's module: nothing compiled
        main = driver.Function(b"stub", cfg.kernel_names["main"], cfg.smem_bytes)
        comb = driver.Function(b"stub", cfg.kernel_names["combine"], 0) if "combine" in cfg.kernel_names else None
        return main, comb

    serving._functions = functools.lru_cache(maxsize=512)(functions)
    return cuda


@contextlib.contextmanager
def cuda_allocs_on_cpu() -> Iterator[None]:
    """torch.empty / zeros / full asked for a CUDA device allocate on the CPU: for the first call of a signature
    (its split-KV scratch, a full cache's lengths), outside what is timed."""
    import torch

    real = torch.empty, torch.zeros, torch.full

    def on_cpu(make: Callable) -> Callable:
        def made(*args: Any, **kw: Any) -> Any:
            dev = kw.get("device")
            if dev is not None and torch.device(dev).type == "cuda":
                kw["device"] = "cpu"
            return make(*args, **kw)
        return made

    torch.empty, torch.zeros, torch.full = (on_cpu(f) for f in real)
    try:
        yield
    finally:
        torch.empty, torch.zeros, torch.full = real


def tensors(point: str) -> tuple[Any, Any, Any, Any]:
    import torch

    batch, n = POINTS[point]
    q = torch.empty(batch, 1, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    kc = torch.empty(batch, n, HEADS_K, HEAD_DIM, dtype=torch.bfloat16)  # never touched: no pages committed
    vc = torch.empty(batch, n, HEADS_K, HEAD_DIM, dtype=torch.bfloat16)
    lens = torch.full((batch,), n, dtype=torch.int32)
    return q, kc, vc, lens


def per_call_us(call: Callable[[], Any], calls: int, loops: int = 7) -> tuple[float, float]:
    """(least, median) over `loops` of the mean wall time per call of `calls` back-to-back calls, in microseconds
    (on a shared machine the least is the steadier figure)."""
    for _ in range(200):
        call()
    times = []
    for _ in range(loops):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            call()
        times.append((time.perf_counter_ns() - t0) / calls / 1e3)
    times.sort()
    return times[0], times[len(times) // 2]


def profile(call: Callable[[], Any], calls: int, top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    out = io.StringIO()
    for order in ("cumulative", "tottime"):
        pstats.Stats(prof, stream=out).sort_stats(order).print_stats(top)
    return out.getvalue()


def instructions(argv: list[str], calls: int) -> None:
    """Run this script under callgrind (--instructions): machine instructions per call, counted only around the
    timed calls (the stub's CALLGRIND_TOGGLE_COLLECT), which a loaded machine does not disturb."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("--instructions needs valgrind (callgrind)")
    with tempfile.TemporaryDirectory(prefix="flashgen-host-cost-") as tmp:
        out = Path(tmp) / "callgrind.out"
        cmd = [valgrind, "--tool=callgrind", "--collect-atstart=no", f"--callgrind-out-file={out}", sys.executable,
               __file__, "--under-callgrind", "--calls", str(calls), *argv]
        run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"})
        if run.returncode:
            raise SystemExit(run.stderr[-4000:])
        names = [line.split(": ", 1)[1] for line in run.stdout.splitlines() if line.startswith("region: ")]
        dumps = sorted(Path(tmp).glob("callgrind.out.*"), key=lambda f: int(f.name.rsplit(".", 1)[1]))
        for name, dump in zip(names, dumps, strict=True):
            total = next(int(line.split()[1]) for line in dump.read_text().splitlines() if line.startswith("summary:"))
            print(f"{name}: {total / calls:,.0f} instructions/call (callgrind, {calls} calls)")


STAGES = (("api", "check_dense"), ("api", "trace_cached"), ("api", "run_mod_plan"), ("ops", "run_mod_plan"),
          ("ops", "dense_mods_forward"), ("ops", "modifier_plan"), ("ops", "modifier_kernel"),
          ("ops", "kernel_block_map"), ("ops", "launch_prefill"), ("modified", "fire_sm90"),
          ("modified", "sm90_maps"), ("serving", "modifier_values"), ("serving", "tmap_box"),
          ("serving", "scale_args"), ("driver", "use_device"))


def on_device_zero() -> None:
    """Tensors say cuda:0; block maps are built on the CPU with torch's own device property (then cached)."""
    import torch

    from flashgen import blockmap

    build = blockmap.from_mask

    def on_cpu(mask: Any, batch: int, heads: int, sq: int, sk: int, bm: int, bn: int, device: Any = None) -> Any:
        prop = torch.Tensor.device
        del torch.Tensor.device  # torch's own getter again while the mask is evaluated
        try:
            return build(mask, batch, heads, sq, sk, bm, bn, "cpu")
        finally:
            torch.Tensor.device = prop

    blockmap.from_mask = on_cpu
    torch.Tensor.device = property(lambda self: torch.device("cuda", 0))


@contextlib.contextmanager
def stage_timers() -> Iterator[dict[str, float]]:
    """Each function of STAGES wrapped in a timer: seconds spent inside it (inclusive), by name."""
    import flashgen.api
    import flashgen.driver
    import flashgen.kernels.modified
    import flashgen.kernels.serving
    import flashgen.ops

    modules = {"api": flashgen.api, "ops": flashgen.ops, "modified": flashgen.kernels.modified,
               "serving": flashgen.kernels.serving, "driver": flashgen.driver}
    spent: dict[str, float] = dict.fromkeys((name for _, name in STAGES), 0.0)
    saved = []
    for mod_name, name in STAGES:
        mod = modules[mod_name]
        fn = getattr(mod, name)

        def timed(*a: Any, _fn: Callable = fn, _name: str = name, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                spent[_name] += time.perf_counter() - t0

        saved.append((mod, name, fn))
        setattr(mod, name, timed)
    try:
        yield spent
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def modifier_calls(cases: list[str], calls: int, stages: bool) -> None:
    """--modifier: the plain dense call and each case's, forward and forward under autograd, per call."""
    import torch

    import flashgen
    from flashgen import bench_flex
    from flashgen.mask_bands import builtin_for

    on_device_zero()
    batch, n = 4, 4096
    q, k, v = (torch.empty(batch, n, 16, 128, dtype=torch.bfloat16) for _ in range(3))
    by_name = {c.name: c for c in bench_flex.cases(n, batch, 16, "cpu", names=tuple(cases))}
    entries = {"plain": lambda: flashgen.attention(q, k, v)}
    cuda_only = {"plain"}  # calls whose autograd runs flashgen's operators, CUDA-only: the built-in kernels'
    for name in cases:
        c = by_name[name]
        entries[name] = functools.partial(flashgen.attention, q, k, v, score_mod=c.score_mod, mask_mod=c.mask_mod)
        mods = bench_flex.case_mods(c)
        if mods is None or (mods.mask_mod is not None and builtin_for(mods.mask_mod, mods.score_mod, False, n, n)):
            cuda_only.add(name)  # a band of diagonals (causal, a window) or no modifier: the built-in kernels too
        if c.builtin:  # the same mask through flashgen's own arguments
            entries[f"{name} built-in"] = functools.partial(flashgen.attention, q, k, v, **c.builtin)
            cuda_only.add(f"{name} built-in")
    for grad in (False, True):
        for name, call in entries.items():
            if grad and name in cuda_only:
                continue
            for t in (q, k, v):
                t.requires_grad_(grad)
            with torch.set_grad_enabled(grad), cuda_allocs_on_cpu():
                call()  # the first call of the signature: its kernel chosen, its block map built
                least, median = per_call_us(call, calls)
                line = f"{name}{' (autograd)' if grad else ''}: {least:.1f} us/call least, {median:.1f} median"
                if stages:
                    with stage_timers() as spent:
                        per_call_us(call, calls, loops=1)
                    line += " | " + ", ".join(f"{k} {v / (calls + 200) * 1e6:.1f}" for k, v in
                                             sorted(spent.items(), key=lambda kv: -kv[1]) if v)
            print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--point", choices=sorted(POINTS), action="append", help="default: b1x8k")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--instructions", action="store_true",
                    help="count instructions per call under callgrind instead of timing (slow: minutes)")
    ap.add_argument("--under-callgrind", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--modifier", action="append", metavar="CASE",
                    help="a dense call with this case of bench --kind flex (e.g. document) instead of decode")
    ap.add_argument("--stages", action="store_true", help="--modifier: time per call of each step of the path")
    args = ap.parse_args()
    points = args.point or ["b1x8k"]
    if args.instructions:
        instructions([a for p in points for a in ("--point", p)], min(args.calls, 500))
        return
    cuda = stub_cuda()
    if args.modifier:
        modifier_calls(args.modifier, min(args.calls, 2000), args.stages)
        return
    import torch

    import flashgen

    torch.set_grad_enabled(True)  # as a user's loop would be: the call asks autograd itself
    for point in points:
        q, kc, vc, lens = tensors(point)
        calls = {
            "attention_with_kvcache": lambda: flashgen.attention_with_kvcache(q, kc, vc, cache_seqlens=lens),
            "attention": lambda: flashgen.attention(q, kc, vc),
        }
        for name, call in calls.items():
            with cuda_allocs_on_cpu():
                call()  # the first call of the signature: checks, choices, its plan
            before = cuda.stub_launches()
            call()
            per = cuda.stub_launches() - before
            if args.under_callgrind:
                for _ in range(50):
                    call()
                print(f"region: {point} {name}", flush=True)
                cuda.stub_count(1)
                for _ in range(args.calls):
                    call()
                cuda.stub_count(0)
                continue
            least, median = per_call_us(call, args.calls)
            print(f"{point} {name}: {least:.2f} us/call least, {median:.2f} median on this CPU ({per} "
                  "cuLaunchKernel a call, stubbed)")
            if not args.no_profile:
                print(profile(call, min(args.calls, 5000), args.top))


if __name__ == "__main__":
    main()
