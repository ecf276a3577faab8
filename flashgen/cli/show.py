"""`flashgen show`: the tuned table, from the store or from a fleet's study storage."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from flashgen.paths import tuned_dir
from flashgen.problem import gpu_slug
from flashgen.store import read_store

from flashgen import fleet
from flashgen.studies import describe, resolve
from .common import open_storage, table


def add_parser(sub: Any) -> None:
    s = sub.add_parser("show", help="print the tuned table")
    s.add_argument("--gpu", default=None, help="only this GPU (its name, e.g. 'NVIDIA H200', or file slug)")
    s.add_argument("--tuned-dir", type=Path, default=None, help="tuned store directory")
    s.add_argument("--from-storage", default=None, metavar="STORAGE",
                   help="show the winners held in this study storage (URL or journal path) instead of the store")
    s.set_defaults(run=run)


def entry_row(e: dict) -> list:
    """kernel, ms, TFLOP/s, default ms, speedup, date of a store entry."""
    d = e.get("default") or {}
    speed = f"{d['median_ms'] / e['median_ms']:.2f}x" if d.get("median_ms") else "-"
    if e.get("num_splits"):  # a decode entry: its split count, and K/V read rate rather than TFLOP/s
        return [f"{e.get('kernel', '?')} x{e['num_splits']}", f"{e['median_ms']:.4f}", f"{e.get('tb_s') or 0:.2f} TB/s",
                f"{d['median_ms']:.4f}" if d.get("median_ms") else "-", speed, e.get("date", "?")]
    return [e.get("kernel", "?"), f"{e['median_ms']:.4f}", f"{e.get('tflops') or 0:.1f}",
            f"{d['median_ms']:.4f}" if d.get("median_ms") else "-", speed, e.get("date", "?")]


def show_doc(doc: dict, where: str) -> None:
    rows = []
    for key, e in sorted(doc["entries"].items()):
        kernel, ms, tf, dms, speed, date = entry_row(e)
        rows.append([key, kernel, ms, tf, dms, speed, e.get("trials", "?"), date])
    print(f"{doc['gpu'].get('name')} ({doc['gpu'].get('arch')}): {where}")
    print(table(rows, ["problem", "kernel", "ms", "TFLOP/s", "default ms", "speedup", "trials", "date"]) + "\n")


def run(args: argparse.Namespace) -> int:
    if args.from_storage:

        where = describe(resolve(args.from_storage))
        open_storage(args.from_storage)
        shown = 0
        for (gpu, arch), entries in sorted(fleet.collect(args.from_storage).items()):
            if args.gpu and args.gpu not in (gpu, gpu_slug(gpu, arch)):
                continue
            shown += 1
            show_doc({"gpu": {"name": gpu, "arch": arch}, "entries": entries}, f"{where} (not in the store; "
                     "write it with tune --collect)")
        if not shown:
            print(f"no verified results{' for ' + args.gpu if args.gpu else ''} in {where}")
        return 0
    root = args.tuned_dir or tuned_dir()
    files = sorted(Path(root).glob("*.json"))
    shown = 0
    for path in files:
        doc = read_store(path)
        if args.gpu and args.gpu not in (path.stem, doc["gpu"].get("name")):
            continue
        shown += 1
        show_doc(doc, str(path))
    if not shown:
        print(f"no tuned results{' for ' + args.gpu if args.gpu else ''} in {root}; run: flashgen tune --arch sm80")
    return 0


