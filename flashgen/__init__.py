"""flashgen: FlashAttention CUDA kernels generated from templates, compiled, verified and tuned per GPU.

Pipeline, one module per step: config -> render -> compile -> launch -> verify -> bench
-> search -> store -> export; `api` holds the public entry points.
"""
from . import fp8  # flashgen.fp8.quantize / emulate after `import flashgen` (torch imported on call)
from .__version__ import __version__
from .api import Kernel, attention, choose_config, load, reload
from .compile import CompileError, CompiledKernel, Resources, compile_kernel
from .config import ConfigError, KernelConfig, default_config, space
from .render import render
from .serving import attention_varlen, attention_with_kvcache
from .store import StoreError

__all__ = [
    "__version__", "fp8", "attention", "attention_varlen", "attention_with_kvcache", "load", "reload", "Kernel", "choose_config", "KernelConfig", "ConfigError", "default_config",
    "space", "render", "compile_kernel", "CompiledKernel", "CompileError", "Resources", "StoreError",
]
