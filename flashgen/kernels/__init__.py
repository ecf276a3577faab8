"""The kernels by kind, each with its launcher: dense forward (`dense`), backward (`backward`), serving forward
(`serving`: varlen/prefill, KV cache/decode, split-KV). They run a given kernel; flashgen.resolve chooses it."""
