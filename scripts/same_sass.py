"""Whether a template change leaves the machine code alone: SASS of the same kernels rendered by a base checkout's
templates and by the working tree's, compared instruction by instruction (no GPU needed).

    mkdir .ab-base && git archive HEAD templates | tar -x -C .ab-base
    python scripts/same_sass.py --base .ab-base/templates --tests fwd fp8 --store
    python scripts/same_sass.py --base .ab-base/templates --tests fwd fp8 --sample 60   # a quick spread of them
    python scripts/same_sass.py --base .ab-base/templates --tests bwd serving --store --backward --family sm90 --sample 16
    python scripts/same_sass.py --base .ab-base/templates --store --backward --family sm90 --skip-functions _pre _convert
    python scripts/same_sass.py --base .ab-base/templates --tests serving --flex --backward --family sm90

A refactor of the templates (a helper, a renamed local) whose kernels all compile to identical SASS needs no new
GPU run; one that changes any is a kernel change. Prints how many are identical and names the others. Needs
nvdisasm or cuobjdump (pip install nvidia-cuda-nvdisasm).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from flashgen.compile import CompileError, compile_kernel, disassemble, disassembler, target_for  # noqa: E402
from flashgen.config import BwdConfig  # noqa: E402

from fill_kernel_cache import SUITES, chosen_configs, default_configs  # noqa: E402

_ADDR = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/")
_SECTION = re.compile(r"(?:^//-+ \.text\.|Function : )(\S+)")  # nvdisasm's and cuobjdump's function headers
_LABEL = re.compile(r"\.L_x_\d+")


def sass_digest(cubin: bytes, skip: tuple[str, ...] = ()) -> str:
    """A digest of the instructions alone (addresses dropped; the ELF around them differs with the source), leaving
    out the functions whose names end with one of `skip`. With `skip`, branch labels are numbered per function (the
    disassembler numbers them across the file, so a change in one function renumbers the others')."""
    lines, keep, labels = [], True, {}
    for line in disassemble(cubin).splitlines():
        section = _SECTION.search(line)
        if section:
            keep = not section.group(1).endswith(skip)  # endswith(()) is False: nothing skipped
            labels = {}
            if keep:
                lines.append(section.group(1))
        elif keep and _ADDR.match(line):
            ins = _ADDR.sub("", line).strip()
            if skip:
                ins = _LABEL.sub(lambda m: f".L{labels.setdefault(m.group(0), len(labels))}", ins)
            lines.append(ins)
    if not lines:
        raise SystemExit("no instructions in the disassembly")
    return hashlib.sha1("\n".join(lines).encode()).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, required=True, help="the base checkout's templates/ directory")
    ap.add_argument("--arch", default="sm90")
    ap.add_argument("--tests", nargs="*", choices=SUITES, default=None, help="the GPU suites' kernels (all if bare)")
    ap.add_argument("--store", action="store_true", help="every tuned kernel")
    ap.add_argument("--flex", action="store_true", help="the modifier kernels of `bench --kind flex` (needs torch)")
    ap.add_argument("--backward", action="store_true", help="only the backward's kernels (a change under a bwd template)")
    ap.add_argument("--family", default=None, help="only this template family's kernels (sm80, sm90)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--skip-functions", nargs="+", default=(), metavar="SUFFIX",
                    help="leave out the __global__ functions whose names end so (e.g. _pre _convert: a change to "
                         "those alone, the main kernels compared)")
    ap.add_argument("--sample", type=int, default=None, metavar="N",
                    help="only N of the chosen kernels, evenly spread over them by name (the same N every run)")
    args = ap.parse_args()
    cfgs = sorted(chosen_configs(args.arch, args.tests, args.store, flex=args.flex) or default_configs(args.arch),
                  key=lambda c: c.name)
    if args.backward:
        cfgs = [c for c in cfgs if isinstance(c, BwdConfig)]
    if args.family:
        cfgs = [c for c in cfgs if c.family == args.family]
    if args.sample is not None and args.sample < len(cfgs):
        cfgs = [cfgs[i * len(cfgs) // args.sample] for i in range(args.sample)]
    if disassembler() is None:
        raise SystemExit("neither nvdisasm nor cuobjdump found (pip install nvidia-cuda-nvdisasm)")
    render = importlib.import_module("flashgen.render")

    def digest(c) -> str | None:
        try:
            kernel = compile_kernel(c, target_for(args.arch, c.family))
        except CompileError:
            return None  # a kernel one side cannot build (a new tile the base's templates do not have)
        return sass_digest(kernel.cubin, tuple(args.skip_functions))

    def digests() -> list[str | None]:
        with ThreadPoolExecutor(args.jobs) as pool:
            return list(pool.map(digest, cfgs))

    new = digests()
    render.template_env.cache_clear()
    render.render.cache_clear()
    with mock.patch.object(render, "templates_dir", lambda: args.base.resolve()):
        old = digests()
    render.template_env.cache_clear()
    render.render.cache_clear()
    differ = [c.name for c, a, b in zip(cfgs, new, old) if a != b]
    print(f"{len(cfgs) - len(differ)} of {len(cfgs)} kernels compile to identical SASS")
    for c, a, b in zip(cfgs, new, old):
        if a != b:
            print("differs:" if a and b else "fails to build in the base:" if a else "fails to build:", c.name)
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
