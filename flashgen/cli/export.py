"""`flashgen export`: tuned kernels (or serving kernels by feature set) as .cu + launch header for a C++ project."""
from __future__ import annotations

import argparse
import itertools
from pathlib import Path
from typing import Any

from flashgen import config as C
from flashgen.checks import Mods
from flashgen.export import export, export_configs
from flashgen.kernels.serving import SM90_MODIFIER_FEATURES, serve_config, sm90_modifier_config

from .common import CliError, causal_list, check_choices, int_list, load_modifier, str_list


def add_parser(sub: Any) -> None:
    e = sub.add_parser("export", help="write tuned kernels as .cu + launch header for a C++ project")
    e.add_argument("--arch", default="sm80", help="template family to export (default sm80; sm90 with --score-mod / "
                                                  "--mask-mod: the modifier kernel flashgen.attention takes on Hopper)")
    e.add_argument("--out", type=Path, required=True, help="output directory")
    e.add_argument("--gpu", default=None, help="only kernels tuned on this GPU (name or file slug)")
    e.add_argument("--tuned-dir", type=Path, default=None, help="tuned store directory")
    # Serving kernels are not tuned (the store holds none): --features picks them the way
    # attention_varlen / attention_with_kvcache do (flashgen.kernels.serving.serve_config).
    e.add_argument("--features", type=str_list, action="append", default=None, metavar="F,F,...",
                   help=f"export serving kernels with these features (of {','.join(C.FEATURES)}) instead of the "
                        "tuned store, tiles as flashgen.kernels.serving chooses them; repeat for several sets")
    e.add_argument("--head-dim", type=int_list, default=[64, 128], help="with --features: head dims (default 64,128)")
    e.add_argument("--dtype", type=str_list, default=["bf16"], help="with --features: dtypes (default bf16)")
    e.add_argument("--causal", choices=("yes", "no", "both"), default="both", help="with --features: masking (default both)")
    e.add_argument("--rows", type=int, default=None,
                   help="with --features: query rows per sequence the kernels serve (seqlen_q, times heads/heads_k "
                        "with pack_gqa); up to 32 takes the decode tiles (default: 1 with paged or pack_gqa, else 1024)")
    e.add_argument("--score-mod", default=None, metavar="FILE.py:FUNC",
                   help="export the serving kernel with this score_mod(score, b, h, q_idx, kv_idx) compiled in (its "
                        "CUDA expression in the .cu, its tensors' slots in the header); with or without --features")
    e.add_argument("--mask-mod", default=None, metavar="FILE.py:FUNC",
                   help="likewise a mask_mod(b, h, q_idx, kv_idx) (true: keep); its kernel reads a block map unless "
                        "--block-map no")
    e.add_argument("--block-map", choices=("yes", "no"), default=None,
                   help="with --mask-mod or alone: the kernel visits the key tiles of a block map (default: yes with "
                        "--mask-mod)")
    e.add_argument("--gpu-arch", default="sm80",
                   help=f"with --features: the GPU to build and fit them for, one of {', '.join(C.ARCHS)} (default sm80)")
    e.set_defaults(run=run)


def serving_configs(args: argparse.Namespace) -> list[C.KernelConfig]:
    """export --features: the serving kernel of each feature set x head dim x dtype x mask, chosen by
    flashgen.kernels.serving.serve_config for --rows rows on --gpu-arch (what the runtime would launch)."""
    if args.arch == "sm90" and (args.score_mod or args.mask_mod):
        return sm90_modifier_configs(args)
    if args.arch != "sm80":
        raise CliError(f"--arch {args.arch}: serving kernels are family sm80 (they run on Hopper too: --gpu-arch sm90; "
                       "with --score-mod / --mask-mod, --arch sm90 exports the sm90 family's modifier kernel)")
    if args.gpu or args.tuned_dir:
        raise CliError("--features exports serving kernels, which are not tuned: drop --gpu and --tuned-dir")
    check_choices("head-dim", args.head_dim, C.HEAD_DIMS)
    check_choices("dtype", args.dtype, C.DTYPES)
    check_choices("gpu-arch", [args.gpu_arch], tuple(C.ARCHS))
    if args.rows is not None and args.rows < 1:
        raise CliError(f"--rows must be at least 1; got {args.rows}")
    mods = modifier_fields(args)
    cfgs = []
    for feats in args.features or [[]]:
        if feats or not mods:  # no feature set: the dense kernel with the modifiers
            check_choices("features", feats, C.FEATURES)
        rows = args.rows if args.rows is not None else (1 if {"paged", "pack_gqa"} & set(feats) else 1024)
        for d, dtype, causal in itertools.product(args.head_dim, args.dtype, causal_list(args.causal)):
            try:
                cfg = serve_config(d, dtype, causal, rows, args.gpu_arch, **{f: True for f in feats}, **mods)
            except ValueError as e:  # a feature rule (ConfigError) or no tile that fits
                raise CliError(f"--features {','.join(feats)}: {e}") from None
            cfgs.append(cfg)
    return cfgs


def sm90_modifier_configs(args: argparse.Namespace) -> list[C.KernelConfig]:
    """export --arch sm90 --score-mod / --mask-mod: the sm90 family's forward that flashgen.attention takes on Hopper
    for these modifiers (flashgen.kernels.serving.sm90_modifier_config: its schedule, a block map with a mask_mod),
    per head dim x dtype x mask, with --features window and / or sinks where given."""
    if args.gpu or args.tuned_dir or args.rows is not None or args.block_map is not None:
        raise CliError("--arch sm90 exports the modifier kernel flashgen.attention takes on Hopper: drop --gpu, "
                       "--tuned-dir, --rows and --block-map")
    check_choices("head-dim", args.head_dim, C.HEAD_DIMS)
    check_choices("dtype", args.dtype, C.DTYPES)
    mods = dict(score_mod=load_modifier(args.score_mod, "score") if args.score_mod else None,
                mask_mod=load_modifier(args.mask_mod, "mask") if args.mask_mod else None)
    cfgs = []
    for feats in args.features or [[]]:
        if feats:
            check_choices("features", feats, SM90_MODIFIER_FEATURES)
        extra = dict(window=(64, 64) if "window" in feats else (-1, -1), sinks=True if "sinks" in feats else None)
        for d, dtype, causal in itertools.product(args.head_dim, args.dtype, causal_list(args.causal)):
            cfg = sm90_modifier_config(d, dtype, causal, Mods(**mods, **extra))
            if cfg is None:
                raise CliError(f"the sm90 family has no modifier kernel for head_dim {d}, {dtype}"
                               f"{' with ' + ','.join(feats) if feats else ''}: export --arch sm80 (it runs on Hopper)")
            cfgs.append(cfg)
    return cfgs


def modifier_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The KernelConfig fields --score-mod, --mask-mod and --block-map give (the modifiers traced here, so that the
    render finds their expressions)."""
    out: dict[str, Any] = {}
    if args.score_mod:
        out["score_mod"] = load_modifier(args.score_mod, "score").digest
    if args.mask_mod:
        out["mask_mod"] = load_modifier(args.mask_mod, "mask").digest
    block_map = args.block_map == "yes" if args.block_map is not None else bool(args.mask_mod)
    if block_map:
        out["block_map"] = True
    return out


def run(args: argparse.Namespace) -> int:
    if args.features or args.score_mod or args.mask_mod or args.block_map == "yes":
        cfgs = serving_configs(args)
        files = export_configs(cfgs, args.out, args.arch if args.arch == "sm90" else args.gpu_arch)
        kernels = sum(1 for f in files if f.suffix == ".cu")
        print(f"wrote {kernels} serving kernels ({len(files)} files) to {args.out}")
        return 0
    check_choices("arch", [args.arch], C.FAMILIES)
    files = export(args.arch, args.out, args.tuned_dir, args.gpu)
    kernels = sum(1 for f in files if f.suffix == ".cu")
    print(f"wrote {kernels} kernels ({len(files)} files) to {args.out}")
    if not kernels:
        print("nothing tuned for this family yet: run flashgen tune first")
    return 0


