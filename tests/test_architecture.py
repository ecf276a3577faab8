"""The package's layers, read from its source: imports point one way (bottom to top), none in a circle, no module
takes another's private names, imports of flashgen's own modules sit at module top (a few, each saying why, wait
for torch), and softmax_scale goes from `flashgen.attention` to the launch through four modules."""
from __future__ import annotations

import ast
import struct
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "flashgen"

# Module (or package prefix) -> layer, bottom to top. A module may import from its own layer or below.
LAYERS = {
    # 0: pure data and rules
    "flashgen.__version__": 0, "flashgen.paths": 0, "flashgen.config": 0, "flashgen.abi": 0, "flashgen.problem": 0,
    "flashgen.grids": 0,
    "flashgen.tensors": 0, "flashgen.checks": 0, "flashgen.fp8": 0, "flashgen.schedule": 0, "flashgen.modifiers": 0,
    "flashgen.blockmap": 0, "flashgen.mask_bands": 0, "flashgen.modifier_grads": 0, "flashgen.head_dims": 0,
    "flashgen.render": 1,
    "flashgen.compile": 2,
    # generic launching: the driver, streams, argument packing
    "flashgen.driver": 3, "flashgen.launch": 3,
    # the kernels by kind, each with its launcher
    "flashgen.kernels": 4,
    # which kernel: the tuned store and every lookup of it
    "flashgen.store": 5, "flashgen.resolve": 5,
    # the torch operators and autograd
    "flashgen.ops": 6, "flashgen.traced_modifiers": 6,
    # the public face
    "flashgen.api": 7, "flashgen": 7, "flashgen.integrations": 7,
    # on top: verification, timing, tuners, benches, comparisons, export, the command line
    "flashgen.verify": 8, "flashgen.bench": 8, "flashgen.backend": 8, "flashgen.studies": 8, "flashgen.search": 8,
    "flashgen.worker": 8, "flashgen.fleet": 8, "flashgen.tune_decode": 8, "flashgen.tune_varlen": 8, "flashgen.tunable": 8,
    "flashgen.tune_modifier": 8,
    "flashgen.bench_serving": 8, "flashgen.bench_step": 8, "flashgen.bench_flex": 8, "flashgen.compare": 8, "flashgen.export": 8, "flashgen.cli": 8,
    # `python -m flashgen`: the command line
    "flashgen.__main__": 9,
}
MAX_LOCAL_IMPORTS = 10
PATH = {"flashgen.api", "flashgen.ops", "flashgen.kernels.dense", "flashgen.launch"}  # softmax_scale's, a torch call


def layer(module: str) -> int:
    """The layer of a module: its own entry, else its package's (flashgen.kernels.dense: flashgen.kernels)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return LAYERS[".".join(parts[:n])]
    raise AssertionError(f"{module} has no layer: add it to LAYERS")


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


MODULES = modules()


class Import:
    def __init__(self, importer: str, target: str, name: str | None, line: int, local: bool, comment: str):
        self.importer, self.target, self.name, self.line, self.local, self.comment = (importer, target, name, line,
                                                                                      local, comment)

    def __repr__(self) -> str:
        return f"{self.importer}:{self.line} -> {self.target}{'.' + self.name if self.name else ''}"


def imports() -> list[Import]:
    """Every import of a flashgen module in the package (one per imported name), local ones marked."""
    out = []
    for name, path in MODULES.items():
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                       for n in ast.walk(f)}
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [(f"{module}.{a.name}", None) if f"{module}.{a.name}" in MODULES else (module, a.name)
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [(a.name, None) for a in node.names]
            else:
                continue
            comment = lines[node.lineno - 1].partition("#")[2]
            for target, attr in targets:
                if (target == "flashgen" or target.startswith("flashgen.")) and target != name:
                    out.append(Import(name, target, attr, node.lineno, id(node) in in_function, comment))
    return out


IMPORTS = imports()


def test_every_module_has_a_layer():
    for name in MODULES:
        layer(name)


def test_no_import_cycle():
    graph: dict[str, set[str]] = {}
    for imp in IMPORTS:
        graph.setdefault(imp.importer, set()).add(imp.target)
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(node):] + [node]))
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, path + [node])
        done.add(node)

    for name in MODULES:
        visit(name, [])


def test_no_module_imports_from_a_higher_layer():
    upward = [imp for imp in IMPORTS if layer(imp.target) > layer(imp.importer)]
    assert not upward, "imports from a higher layer: " + ", ".join(map(repr, upward))


def test_no_module_imports_another_modules_private_names():
    private = [imp for imp in IMPORTS if imp.name and imp.name.startswith("_") and not imp.name.startswith("__")]
    assert not private, "private names imported: " + ", ".join(map(repr, private))


def test_few_function_local_imports_each_saying_why():
    local = {(imp.importer, imp.line): imp for imp in IMPORTS if imp.local}  # one per statement
    assert len(local) <= MAX_LOCAL_IMPORTS, f"{len(local)} function-local imports of flashgen modules: {list(local)}"
    silent = [imp for imp in local.values() if "(" not in imp.comment]  # "# noqa: ...  (why)"
    assert not silent, "function-local imports without a reason on their line: " + ", ".join(map(repr, silent))


def test_the_checks_catch_what_they_should(tmp_path, monkeypatch):
    """The rules above fail on a package that breaks them (an upward, private, cyclic and silent local import)."""
    bad = tmp_path / "flashgen"
    (bad / "kernels").mkdir(parents=True)
    (bad / "__init__.py").write_text("")
    (bad / "kernels" / "__init__.py").write_text("")
    (bad / "config.py").write_text("from .kernels.dense import Kernel\n")
    (bad / "kernels" / "dense.py").write_text("from ..config import _hidden\n\n\ndef f():\n    from .. import config\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PKG", bad)
    monkeypatch.setattr(sys.modules[__name__], "MODULES", modules())
    monkeypatch.setattr(sys.modules[__name__], "IMPORTS", imports())
    for rule in (test_no_import_cycle, test_no_module_imports_from_a_higher_layer,
                 test_no_module_imports_another_modules_private_names, test_few_function_local_imports_each_saying_why):
        with pytest.raises(AssertionError):
            rule()


def test_softmax_scale_reaches_the_launch_through_four_modules(monkeypatch):
    """attention -> ops (torch) -> kernels.dense -> launch: the modules whose functions take softmax_scale on a
    torch call, in order, each entered once in a row (the GPU faked: CPU tensors posing as cuda:0)."""
    torch = pytest.importorskip("torch")
    import flashgen
    import flashgen.driver as driver
    import flashgen.kernels.dense as dense
    import flashgen.store as store
    from flashgen import resolve
    from flashgen.compile import CompiledKernel, Resources
    from flashgen.tensors import View

    class FakeFn:
        def launch(self, grid, threads, params, stream, programmatic=False):
            pass

    h200 = driver.DeviceInfo("NVIDIA H200", "sm90", 132)
    monkeypatch.setattr(driver, "device_info", lambda device=None: h200)
    monkeypatch.setattr(driver, "use_device", lambda device: 0)
    monkeypatch.setattr(driver, "primary_context_id", lambda device: 1)
    monkeypatch.setattr(driver, "get_function", lambda *a, **kw: FakeFn())
    monkeypatch.setattr(driver, "tensor_map", lambda dt, ptr, dims, st, box, sw: struct.pack("=Q", ptr) * 16)
    monkeypatch.setattr(store, "current_gpu", lambda: (h200.name, h200.arch))
    monkeypatch.setattr(resolve, "compiled_kernel", lambda cfg, target: CompiledKernel(
        cfg, target, "", b"", Resources(1, 0, 0, 0, cfg.smem_bytes), ""))
    monkeypatch.setattr(dense, "current_stream", lambda device: 7)
    monkeypatch.setattr(dense, "view", lambda x, name: View(x, "torch", x.data_ptr(), tuple(x.shape), x.stride(),
                                                            "bf16", 0))
    flashgen.reload()
    q = torch.randn(1, 64, 2, 64, dtype=torch.bfloat16)
    chains: set[tuple[str, ...]] = set()

    def takes_scale(frame) -> bool:
        code = frame.f_code
        return ("softmax_scale" in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
                and frame.f_globals.get("__name__", "").startswith("flashgen"))

    def profile(frame, event, arg):
        if event == "call" and takes_scale(frame):
            chain, f = [], frame
            while f is not None:
                if takes_scale(f) and (not chain or chain[-1] != f.f_globals["__name__"]):
                    chain.append(f.f_globals["__name__"])
                f = f.f_back
            chains.add(tuple(reversed(chain)))

    try:
        for call in range(2):  # the first call makes the plan (the scale packed into it), the second runs by it
            sys.setprofile(profile)
            try:
                flashgen.attention(q, q, q, causal=True, softmax_scale=0.1)
            finally:
                sys.setprofile(None)
            for chain in chains:  # from the public call down, never back up (no module entered twice)
                assert chain[0] == "flashgen.api" and [layer(m) for m in chain] == sorted(
                    (layer(m) for m in chain), reverse=True) and len(set(chain)) == len(chain), chain
            path = {m for c in chains for m in c}
            assert path <= PATH and (call or path == PATH), chains
            chains.clear()
    finally:
        flashgen.reload()
