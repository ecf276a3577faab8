"""flashgen: FlashAttention CUDA kernels generated from templates, compiled, verified and tuned per GPU.

Layers, bottom to top: config, problem, tensors, checks, paths (data and rules) -> render -> compile ->
driver, launch -> kernels (dense, backward, serving) -> store, resolve -> ops (torch operators) -> api (the
public entry points); verify, bench, search, the tuners and export sit on top.
"""
from . import fp8  # flashgen.fp8.quantize / emulate after `import flashgen` (torch imported on call)
from .__version__ import __version__
from .api import (Kernel, attention, attention_varlen, attention_with_kvcache, check_errors, choose_config, load,
                  reload)
from .compile import CompileError, CompiledKernel, Resources, compile_kernel
from .config import ConfigError, KernelConfig, default_config, space
from .render import render
from .store import StoreError

__all__ = [
    "__version__", "fp8", "attention", "attention_varlen", "attention_with_kvcache", "check_errors", "load", "reload", "Kernel", "choose_config", "KernelConfig", "ConfigError", "default_config",
    "space", "render", "compile_kernel", "CompiledKernel", "CompileError", "Resources", "StoreError",
]
