"""Compile, without a GPU, every kernel a GPU run will load, into FLASHGEN_CACHE_DIR.

    FLASHGEN_CACHE_DIR=.kcache python scripts/fill_kernel_cache.py --arch sm90 [--tests [SUITE ...]] [--store]
        [--around-store FIELD ...] [--space FIELD=V,... ...] [--defaults] [--flex] [--into DIR]

Carry the directory to the GPU machine and point FLASHGEN_CACHE_DIR at it there: device minutes
then go to the GPU, not to nvcc. --tests: the GPU test suite's kernels; --store: every tuned
kernel; --around-store FIELD ...: what `tune --around-store` tries (each stored dense forward or backward with only
these fields free); --space FIELD=V,... ...: what a restricted `tune` tries (the family's space, both masks, of
the head_dim and dtype values given, only configurations with these values of the other fields, e.g. `--space
head_dim=64 dtype=bf16,fp16 block_m=192 block_n=128,192`); --defaults: each family's default for every head dim, dtype and mask; --flex: the modifier kernels of `bench --kind
flex` (FlexAttention's examples). --into DIR: also copy
just these kernels' entries into DIR (a cache that has grown past what one run may carry).
"""
from __future__ import annotations

import argparse
import itertools
import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flashgen.compile import CompileError, cache_entries, compile_kernel, target_for  # noqa: E402
from flashgen.config import (FP8_DTYPES, FP8_HEAD_DIMS, HALF_DTYPES, FAMILIES, HEAD_DIMS, BwdConfig, KernelConfig,  # noqa: E402
                             around, bwd_space, default_config, space)
from flashgen.store import config_from_entry, read_store  # noqa: E402


SUITES = ("fwd", "fp8", "api", "bwd", "serving", "exp2_fma", "sinks", "head_dims")


def test_suite_configs(arch: str, suites: tuple[str, ...] = SUITES) -> set[KernelConfig | BwdConfig]:
    """The kernels the named GPU test modules load (fwd: test_gpu_fwd, bwd: test_gpu_bwd, ...)."""
    sys.path.insert(0, str(ROOT / "tests"))
    out: set[KernelConfig | BwdConfig] = set()
    if "fwd" in suites:
        import test_gpu_fwd  # noqa: PLC0415
        out |= {c for hd, dt, causal in itertools.product(HEAD_DIMS, HALF_DTYPES, (False, True))
                for c in test_gpu_fwd.configs_for(hd, dt, causal, arch)} | set(test_gpu_fwd.pack_configs(arch))
    if "fp8" in suites:
        import test_gpu_fp8  # noqa: PLC0415
        out |= set(test_gpu_fp8.fp8_configs(arch)) | set(test_gpu_fp8.pack_fp8_configs(arch))
    if "api" in suites:
        import test_gpu_api  # noqa: PLC0415
        out |= set(test_gpu_api.family_configs(arch))
    if "bwd" in suites:
        import test_gpu_bwd  # noqa: PLC0415
        out |= set(test_gpu_bwd.bwd_configs(arch)) | set(test_gpu_bwd.forward_configs(arch))
    if "serving" in suites:
        import test_gpu_key_warps  # noqa: PLC0415
        import test_gpu_serving  # noqa: PLC0415
        import test_gpu_serving_bwd  # noqa: PLC0415
        import test_gpu_tune_decode  # noqa: PLC0415
        import test_gpu_tune_varlen  # noqa: PLC0415
        out |= (test_gpu_serving.serving_configs(arch) | test_gpu_serving_bwd.serving_bwd_configs(arch)
                | test_gpu_tune_decode.tune_decode_configs(arch) | test_gpu_tune_varlen.tune_varlen_configs(arch)
                | test_gpu_key_warps.key_warps_configs(arch))
    if "sinks" in suites:
        import test_gpu_sinks  # noqa: PLC0415

        out |= test_gpu_sinks.sinks_configs(arch)
    if "head_dims" in suites:
        import test_gpu_head_dims  # noqa: PLC0415
        out |= test_gpu_head_dims.head_dim_configs(arch)
    if "exp2_fma" in suites and arch == "sm90":
        import test_gpu_exp2_fma  # noqa: PLC0415
        out |= {c for hd, dt, causal in itertools.product((64, 128), HALF_DTYPES, (False, True))
                for c in test_gpu_exp2_fma.configs(hd, dt, causal)}
    return out


def store_configs(arch: str, problems: list[str] | None = None) -> set[KernelConfig]:
    out = set()
    for path in (ROOT / "tuned").glob("*.json"):
        for key, e in read_store(path)["entries"].items():
            if problems and not any(p in key for p in problems):
                continue
            cfg = config_from_entry(e)
            if cfg.unfit_reason(arch) is None:
                out.add(cfg)
    return out


def around_store_configs(arch: str, free: list[str], gqa: int = 1,
                         problems: list[str] | None = None) -> set[KernelConfig | BwdConfig]:
    """What `tune --around-store FREE [--gqa G]` (and `--pass bwd`) evaluates around each stored dense configuration,
    forward or backward (problems: only around the entries whose problem key holds one of these strings, e.g.
    d128_bf16_causal_s1024)."""
    out: set[KernelConfig | BwdConfig] = set()
    for cfg in store_configs(arch, problems):
        if isinstance(cfg, KernelConfig) and not cfg.serving:
            group = max(gqa, 2 if cfg.pack_gqa else 1)  # a GQA problem's space: its pack_gqa configurations too
            cands = space(cfg.family, cfg.head_dim, cfg.dtype, cfg.causal, group)
        elif isinstance(cfg, BwdConfig) and not (cfg.serving or cfg.deterministic):
            cands = bwd_space(cfg.head_dim, cfg.dtype, cfg.causal, family=cfg.family)
        else:
            continue
        out |= {c for c in around(cfg, cands, free) if c.unfit_reason(arch) is None}
    return out


def parse_restrictions(items: list[str]) -> dict[str, list]:
    """FIELD=V1,V2 items as {field: [values]}: integers as int, yes/no as bool, the rest as given."""
    conv = {"yes": True, "no": False}
    out = {}
    for item in items:
        field, _, vals = item.partition("=")
        out[field.replace("-", "_")] = [int(v) if v.isdigit() else conv.get(v, v) for v in vals.split(",")]
    return out


def space_configs(arch: str, restrict: dict[str, list]) -> set[KernelConfig]:
    family = "sm90" if arch == "sm90" else "sm80"
    return {c for hd, dt, causal in itertools.product(restrict.get("head_dim", HEAD_DIMS),
                                                      restrict.get("dtype", HALF_DTYPES), (False, True))
            for c in space(family, hd, dt, causal, 2 if True in restrict.get("pack_gqa", ()) else 1)
            if c.unfit_reason(arch) is None and all(getattr(c, f) in v for f, v in restrict.items())}


def default_configs(arch: str) -> set[KernelConfig]:
    out = {default_config(hd, dt, c, arch, fam) for hd, dt, c, fam in
           itertools.product(HEAD_DIMS, HALF_DTYPES, (False, True), FAMILIES) if fam != "sm90" or arch == "sm90"}
    if arch == "sm90":
        out |= {default_config(hd, dt, c, arch, "sm90")
                for hd, dt, c in itertools.product(FP8_HEAD_DIMS, FP8_DTYPES, (False, True))}
    return out


def flex_configs(arch: str) -> set[KernelConfig | BwdConfig]:
    """The modifier kernels `bench --kind flex` loads (its cases at 4k and 16k tokens, d128, bf16), each case's forward
    and backward in the sm80 family and, on sm90, in the sm90 family where it builds them (not for a band of
    diagonals: flashgen.attention runs the built-in kernels there); the cases' built-in kernels are --store's and
    --defaults'. Needs torch (the cases are traced on CPU tensors)."""
    from flashgen import bench_flex  # noqa: PLC0415
    from flashgen.kernels.serving import (modifier_config, modifier_digests, sm90_modifier_bwd_config,  # noqa: PLC0415
                                          sm90_modifier_config)
    from flashgen.mask_bands import builtin_for  # noqa: PLC0415
    from flashgen.resolve import modifier_bwd_config  # noqa: PLC0415

    out: set[KernelConfig | BwdConfig] = set()
    for n in (4096, 16384):
        for case in bench_flex.cases(n, 16384 // n, 16, "cpu"):
            mods = bench_flex.case_mods(case)
            if mods is None:  # the plain kernel runs
                continue
            digests = {**modifier_digests(mods), "block_map": mods.mask_mod is not None}  # score_mod, mask_mod, map
            out.add(modifier_config(128, "bf16", False, n, arch, mods))
            out.add(modifier_bwd_config(128, "bf16", False, arch, False, (), **digests))
            if arch == "sm90" and not (mods.mask_mod is not None  # a band: flashgen's own kernels run it
                                       and builtin_for(mods.mask_mod, mods.score_mod, False, n, n)):
                out |= {c for c in (sm90_modifier_config(128, "bf16", False, mods),
                                    sm90_modifier_bwd_config(128, "bf16", False, (), False, *digests.values()))
                        if c is not None}
    return out


def chosen_configs(arch: str, tests: list[str] | None, store: bool, around_store: list[str] | None = None,
                   defaults: bool = False, restrict: dict[str, list] | None = None,
                   gqa: int = 1, problems: list[str] | None = None, flex: bool = False) -> set[KernelConfig | BwdConfig]:
    """The kernels the options name (tests: suite names, [] for all, None for none); each family's defaults when
    they name none."""
    cfgs: set[KernelConfig | BwdConfig] = set()
    if flex:
        cfgs |= flex_configs(arch)
    if tests is not None:
        cfgs |= test_suite_configs(arch, tuple(tests) or SUITES)
    if store:
        cfgs |= store_configs(arch, problems)
    if around_store:
        cfgs |= around_store_configs(arch, [f.replace("-", "_") for f in around_store], gqa, problems)
    if restrict:
        cfgs |= space_configs(arch, restrict)
    if defaults or not (tests is not None or store or around_store or restrict or flex):
        cfgs |= default_configs(arch)
    return cfgs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm90", help="the GPU the run will use, e.g. sm90")
    ap.add_argument("--tests", nargs="*", choices=SUITES, default=None,
                    help="the GPU test suite's kernels: all, or only these modules' (e.g. --tests bwd api)")
    ap.add_argument("--store", action="store_true")
    ap.add_argument("--around-store", nargs="+", default=None, metavar="FIELD")
    ap.add_argument("--gqa", type=int, default=1, help="--around-store for GQA problems of this group (tune --gqa)")
    ap.add_argument("--problems", nargs="+", default=None, metavar="KEY_PART",
                    help="--store / --around-store: only the store entries whose key holds one of these (for "
                         "--around-store, as a tune restricted by --head-dim/--seqlen/--causal), e.g. "
                         "d128_bf16_causal_s1024")
    ap.add_argument("--space", nargs="+", default=None, metavar="FIELD=V,...",
                    help="a restricted tune's space, e.g. head_dim=64 dtype=bf16,fp16 block_m=192 block_n=128,192")
    ap.add_argument("--defaults", action="store_true")
    ap.add_argument("--flex", action="store_true", help="the modifier kernels of `bench --kind flex` (needs torch)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--into", type=Path, default=None, help="copy these kernels' cache entries into this directory")
    args = ap.parse_args()
    cfgs = chosen_configs(args.arch, args.tests, args.store, args.around_store, args.defaults,
                          parse_restrictions(args.space) if args.space else None, args.gqa, args.problems,
                          args.flex)
    failed = []

    used: list[Path] = []  # list.extend from pool threads: atomic under the GIL

    def build(cfg: KernelConfig | BwdConfig) -> None:
        try:
            compile_kernel(cfg, target_for(args.arch, cfg.family))
            if args.into:
                used.extend(cache_entries(cfg, target_for(args.arch, cfg.family)))
        except CompileError as e:
            failed.append(f"{cfg.name}: {str(e).splitlines()[0]}")

    with ThreadPoolExecutor(args.jobs) as pool:  # nvcc runs in subprocesses: threads are enough
        list(tqdm(pool.map(build, sorted(cfgs, key=lambda c: c.name)), total=len(cfgs), desc="compile", unit="kernel"))
    print(f"{len(cfgs) - len(failed)} kernels in {os.environ.get('FLASHGEN_CACHE_DIR', 'the user cache')}")
    if args.into:
        args.into.mkdir(mode=0o700, parents=True, exist_ok=True)
        for f in used:
            shutil.copy2(f, args.into / f.name)
        print(f"{len(used)} files copied into {args.into}")
    for f in failed:
        print("FAILED", f)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
