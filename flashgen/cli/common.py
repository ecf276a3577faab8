"""What the verbs share: argument types, the one-line error, the problem arguments and their checks, tables,
the study storage and torch on a GPU."""
from __future__ import annotations

import argparse
import re
from typing import Any

from flashgen import config as C
from flashgen.modifiers import Modifier, ModifierError, load_file
from flashgen.studies import describe, make_storage, redact_text, resolve

STORAGE_HELP = ("Optuna storage shared by the tuners: a database URL (sqlite:///f.db, postgresql://user@host/db) "
                "or a journal file on a shared filesystem (journal:///shared/f.log, or a path not ending in "
                ".db/.sqlite/.sqlite3); default: SQLite in the user data dir")


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def duration(text: str) -> float:
    """Seconds from "90", "90s", "10m", "1.5h"."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a duration like 90s, 10m or 1h, got {text!r}")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def gpu_list(text: str) -> list[int] | str:
    """"all", or GPU indices such as 0,1 (an index given twice runs two tuners on that GPU)."""
    if text.strip() == "all":
        return "all"
    gpus = int_list(text)
    if not gpus or min(gpus) < 0:
        raise argparse.ArgumentTypeError(f"expected 'all' or GPU indices like 0,1, got {text!r}")
    return gpus


def causal_list(text: str) -> list[bool]:
    return {"yes": [True], "no": [False], "both": [False, True]}[text]


def dtype_list(s: str) -> list[str]:
    """--dtype: names as the config spells them; "fp8" is short for fp8_e4m3."""
    return ["fp8_e4m3" if d == "fp8" else d for d in str_list(s)]


def check_choices(name: str, values: list, allowed: tuple) -> None:
    """CliError unless `values` is a non-empty list of `allowed` ones (the option --`name`)."""
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise CliError(f"--{name} {','.join(map(str, bad)) or '(empty)'}: choose from {','.join(map(str, allowed))}")


def add_problem_args(p: argparse.ArgumentParser) -> None:
    """--arch, --head-dim, --dtype, --causal: the problems of tune, check and bench."""
    p.add_argument("--arch", default="sm80", help=f"template family, one of {', '.join(C.FAMILIES)} (default sm80)")
    p.add_argument("--head-dim", type=int_list, default=[64, 128], help="head dims, e.g. 64,128 (default 64,128)")
    p.add_argument("--dtype", type=dtype_list, default=["bf16"],
                   help="dtypes, e.g. bf16,fp16, or fp8 (e4m3, --arch sm90; default bf16)")
    p.add_argument("--causal", choices=("yes", "no", "both"), default="both", help="masking (default both)")


def validate_problem(args: argparse.Namespace, dense: bool = False) -> None:
    """The arguments of add_problem_args: known family, head dims (`dense`: dense 16-bit problems, which have the
    dense-only head dims too) and dtypes; FP8 only where it is built."""
    check_choices("arch", [args.arch], C.FAMILIES)
    check_choices("head-dim", args.head_dim, C.DENSE_HEAD_DIMS if dense else C.HEAD_DIMS)
    check_choices("dtype", args.dtype, C.DTYPES)
    if set(args.dtype) & set(C.FP8_DTYPES):
        if args.arch != "sm90":
            raise CliError(f"--dtype fp8 is built in family sm90 (FP8 wgmma): use --arch sm90, not {args.arch}")
        bad = [d for d in args.head_dim if d not in C.FP8_HEAD_DIMS]
        if bad:
            raise CliError(f"--head-dim {','.join(map(str, bad))}: FP8 has head dims "
                           f"{','.join(map(str, C.FP8_HEAD_DIMS))}")


def validate_grid(args: argparse.Namespace, counts: tuple[str, ...]) -> None:
    """The problem grid of tune and bench: these counts, --batch-tokens and --heads-dim-total at least 1, and
    positive --seqlen values."""
    for name in (*counts, "batch_tokens", "heads_dim_total"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be at least 1")
    bad = [s for s in args.seqlen if s < 1]
    if bad:
        raise CliError(f"--seqlen values must be positive, got {bad}")


def passes(args: argparse.Namespace) -> list[str]:
    """The passes of `--pass`."""
    p = getattr(args, "pass_", "fwd")
    return ["fwd", "bwd"] if p == "both" else [p]


def check_family(family: str, gpu_name: str, gpu_arch: str) -> None:
    """CliError where the family's kernels need a newer GPU than `gpu_arch`."""
    if C.arch_limits(family).sm > C.arch_limits(gpu_arch).sm if gpu_arch in C.ARCHS else False:
        raise CliError(f"--arch {family} kernels need an {family} or newer GPU; {gpu_name} is {gpu_arch}")


def table(rows: list[list], head: list[str]) -> str:
    cells = [head, *[[str(x) for x in r] for r in rows]]
    w = [max(len(r[i]) for r in cells) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * x for x in w))
    return "\n".join(lines)


def open_storage(storage: str | None, heartbeat_s: int | None = None, grace_s: int | None = None) -> Any:
    """The study storage, or one clear line on why it cannot be opened (server down, no driver, bad URL)."""

    try:
        return make_storage(storage, heartbeat_s, grace_s)
    except ImportError as e:  # the URL's database driver is not installed
        fix = ("pip install -e '.[fleet]' installs it" if e.name == "psycopg2" else
               "install it, or name no driver (postgresql://...) for psycopg2, which pip install -e '.[fleet]' installs")
        raise CliError(f"cannot open {describe(resolve(storage))}: its driver is missing "
                       f"({redact_text(str(e), resolve(storage))}): {fix}") from None
    except Exception as e:  # noqa: BLE001 - SQLAlchemy's and the journal's errors, as one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CliError(f"cannot open {describe(resolve(storage))}: {type(e).__name__}: "
                       f"{redact_text(first, resolve(storage))}") from None


def cuda_torch(what: str, hint: str = "") -> Any:
    """torch, where it can run on a CUDA GPU; else the CliError saying that `what` (e.g. "bench") needs one."""
    try:
        import torch  # optional dependency: only the verbs that time kernels need it
    except ImportError:
        raise CliError(f"{what} needs torch with CUDA on a GPU machine{hint}") from None
    if not torch.cuda.is_available():
        raise CliError(f"{what} needs a CUDA GPU; none is visible{hint}")
    return torch


def load_modifier(spec: str, kind: str) -> Modifier:
    """--score-mod / --mask-mod FILE.py:FUNC (flashgen.modifiers.load_file), its errors as one-line CliErrors."""
    try:
        return load_file(spec, kind)
    except ModifierError as e:
        raise CliError(f"--{kind}-mod {e}") from None
