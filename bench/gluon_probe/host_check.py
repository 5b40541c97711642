"""Why a data-mask call is host-bound: the chosen launcher's fast-launch state and a
cProfile of repeated calls (issue 17; ``python bench/gluon_probe/host_check.py jagged 8192``)."""
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import doc_mask_gpu as dm  # noqa: E402

import neptune_eq as ne  # noqa: E402

name, S = sys.argv[1], int(sys.argv[2])
mask, B, _ = dm.case(name, S)
q, k, v = (torch.randn(B, dm.H, S, dm.D, device="cuda", dtype=torch.float16) for _ in range(3))
ne.flex_attention(q, k, v, mask_mod=mask)
torch.cuda.synchronize()
kern, la, bound = dm.launcher_of(q, k, v, mask)
print(type(la).__name__, la.config, "fast_ok", getattr(la, "fast_ok", None),
      "reason", getattr(la, "fast_reason", None), "grid", getattr(la, "grid", None))
for _ in range(20):
    ne.flex_attention(q, k, v, mask_mod=mask)
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(200):
    ne.flex_attention(q, k, v, mask_mod=mask)
host = (time.perf_counter() - t) / 200 * 1e6
torch.cuda.synchronize()
print(f"host us per call (no sync): {host:.1f}")
pr = cProfile.Profile()
pr.enable()
for _ in range(200):
    ne.flex_attention(q, k, v, mask_mod=mask)
pr.disable()
torch.cuda.synchronize()
pstats.Stats(pr).sort_stats("cumulative").print_stats(25)
