"""Quick check of the sm90 family on small shapes (run under `timeout`: a broken pipeline can hang)."""
import sys

import torch

import flashgen
from flashgen.config import KernelConfig, default_config
from flashgen.verify import verify

cases = [default_config(d, "bf16", c, "sm90", "sm90") for d in (64, 128) for c in (False, True)]
cases += [KernelConfig(64, "fp16", False, 64, 64, 8, 1, "sm90"), KernelConfig(256, "bf16", True, 128, 64, 12, 2, "sm90"),
          KernelConfig(32, "bf16", True, 192, 64, 16, 2, "sm90"), KernelConfig(96, "fp16", False, 128, 64, 12, 3, "sm90")]
cases += [KernelConfig(d, "bf16", c, 128, bn, 12, 2, "sm90", ov, pp) for d, bn in ((128, 128), (256, 64))
          for c in (False, True) for ov, pp in ((True, False), (False, True), (True, True))]
bad = 0
for cfg in cases:
    k = flashgen.load(cfg.head_dim, cfg.dtype, cfg.causal, config=cfg)
    for shape in [(1, 64, 64, 1, 1), (2, 200, 333, 4, 2), (1, 1000, 1000, 2, 2)]:
        r = verify(k.compiled, *shape)
        bad += not r.ok
        print(f"{cfg.name:<48} {str(shape):<22} ok={r.ok} err={r.max_err:.2e} bound={r.bound:.2e} lse={r.lse_err:.2e} {r.reason}",
              flush=True)
torch.cuda.synchronize()
sys.exit(1 if bad else 0)
