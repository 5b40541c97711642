"""What a new size bucket costs the first training step that meets it.

    python bench/new_bucket_cost.py                     # the default (auto): timed where long
    NEPTUNE_EQ_TIME_NEW_BUCKETS=0 python bench/new_bucket_cost.py   # never timed on the call
    NEPTUNE_EQ_TIME_NEW_BUCKETS=1 python bench/new_bucket_cost.py   # always timed on the call

One fwd+bwd of ne.flex_attention (bf16, B=2, H=16, D=128) at S=8192 -- the cold build of
every kernel -- then one at S=2048, a bucket none of them has met: the wall time of each
first step, synchronised.  Under ``auto`` (``choosing/dispatch.time_new_buckets``) a bucket
is timed on the call where its predicted call takes >= 1 ms, else it carries the config a
timed bucket nearby chose.  Run it with an empty ``NEPTUNE_EQ_CACHE`` to see the cold cost.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import neptune_eq as ne  # noqa: E402
from backward_gpu import step_tensors  # noqa: E402


def first_step_seconds(name: str, S: int) -> float:
    kw, q, k, v, g = step_tensors(name, S)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.autograd.grad(ne.flex_attention(q, k, v, **kw), (q, k, v), g)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


if __name__ == "__main__":
    for name in sys.argv[1:] or ["window(256)", "causal"]:
        cold, new = first_step_seconds(name, 8192), first_step_seconds(name, 2048)
        print(f"{name}: first step at S=8192 (cold) {cold:.2f} s, then at S=2048 "
              f"(a new bucket) {new:.2f} s", flush=True)
