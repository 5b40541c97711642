"""Out-of-bounds check of the generated ``tl`` kernels in the Triton interpreter, at
GPU-sized tiles: every unmasked lane of a load, store or atomic must address a tensor
the kernel was given.  (The GPU faults on such a lane only where the address leaves
mapped memory; here every one is caught.)

    python bench/probe/oob_sanitizer.py [--L 300 --S 517] [--rows 64 --keys 64]

Runs a relative-table step (forward, q/k/v and the table's gradients) of
``ne.flex_attention`` on CPU with every kernel launched at the given tile, and reports
the first lane that leaves its tensors (kernel, op, address)."""
from __future__ import annotations

import argparse
import os

os.environ["TRITON_INTERPRET"] = "1"  # (before triton: its kernels run interpreted)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton.runtime.interpreter as interp  # noqa: E402

import neptune_eq as ne  # noqa: E402
from neptune_eq.runtime import tile_configs  # noqa: E402

RANGES: list[tuple[int, int]] = []
FOUND: list[str] = []


def _watch_args():
    orig = interp.GridExecutor._init_args_hst

    def init(self, args_dev, kwargs):
        args_hst, kwargs_hst = orig(self, args_dev, kwargs)
        RANGES.clear()
        for a in list(args_hst) + list(kwargs_hst.values()):
            if isinstance(a, torch.Tensor):
                RANGES.append((a.data_ptr(), a.data_ptr() + a.untyped_storage().nbytes()))
        return args_hst, kwargs_hst
    interp.GridExecutor._init_args_hst = init


def _check(what: str, ptrs, mask):
    p = np.asarray(ptrs.data).reshape(-1)
    m = np.ones_like(p, dtype=bool) if mask is None else np.asarray(mask.data).reshape(-1)
    live = p[m]
    ok = np.zeros_like(live, dtype=bool)
    for lo, hi in RANGES:
        ok |= (live >= lo) & (live < hi)
    if not ok.all() and len(FOUND) < 5:
        bad = live[~ok][:3]
        FOUND.append(f"{what}: {int((~ok).sum())} lanes outside every tensor, e.g. "
                     f"{[hex(int(b)) for b in bad]}")
        import traceback
        FOUND.append("".join(traceback.format_stack(limit=8)[:-2]))


def _watch_memory():
    B = interp.InterpreterBuilder
    load, store, rmw = B.create_masked_load, B.create_masked_store, B.create_atomic_rmw

    def masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        _check("load", ptrs, mask)
        return load(self, ptrs, mask, other, cache_policy, is_volatile)

    def masked_store(self, ptrs, value, mask, cache_policy):
        _check("store", ptrs, mask)
        return store(self, ptrs, value, mask, cache_policy)

    def atomic(self, op, ptr, val, mask, sem, scope):
        _check("atomic", ptr, mask)
        return rmw(self, op, ptr, val, mask, sem, scope)
    B.create_masked_load, B.create_masked_store, B.create_atomic_rmw = masked_load, masked_store, atomic


def _gpu_tiles(rows: int, keys: int):
    orig = tile_configs.candidate_configs

    def configs(ks, target, sms=132):
        out = orig(ks, target, sms)
        if target != "interpreter":
            return out
        c = out[0]
        blocks = {k: (rows if k == f"B_{ks.block_axis}" else keys) if v == 16 else v
                  for k, v in c.blocks.items()}
        return [tile_configs.TileConfig(blocks, c.num_warps, c.num_stages, c.splits)]
    import importlib
    for mod in ("neptune_eq.api", "neptune_eq.choosing.dispatch", "neptune_eq.choosing.choose"):
        setattr(importlib.import_module(mod), "candidate_configs", configs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--L", type=int, default=300)
    ap.add_argument("--S", type=int, default=517)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--keys", type=int, default=64)
    a = ap.parse_args()
    os.environ.setdefault("NEPTUNE_EQ_CACHE", "/tmp/neptune_oob_cache")
    _watch_args()
    _watch_memory()
    _gpu_tiles(a.rows, a.keys)
    torch.manual_seed(0)
    L, S = a.L, a.S
    q = torch.randn(1, 2, L, 64, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 2, S, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    rel = torch.randn(2 * max(L, S), requires_grad=True)
    out = ne.flex_attention(q, k, v, lambda s, b, h, i, j: s + rel[i - j + S])
    torch.autograd.grad(out.float().sum(), (q, k, v, rel))
    print("\n".join(FOUND) if FOUND else "no lane left its tensors")


if __name__ == "__main__":
    main()
