"""GPU probe: what the generated prefill kernels spend beyond a minimal FlashAttention.

    python bench/prefill_probe.py --out DIR [--kernels global,causal,mini] [--configs 0,2]

Runs the forward kernels neptune_eq generated for global and causal attention (B=1,
H=32, S=8192, D=128, fp16; sources in ``bench/results/prefill_kernels_s14/``, made on a
CPU by ``bench/ws_probe/gen_sources.rolling_source``) straight through Triton -- no
egglog needed -- over tile configs, pointer and descriptor (TMA) loads, and variants of
each made by string transforms that change only the per-element softmax arithmetic:

* ``base``   -- as generated;
* ``fma``    -- the exp2 argument as one multiply-add from the raw product,
  ``s * (c * log2e) - m * log2e``, where the causal kernel computed
  ``((s * c) - m) * log2e`` (three tile-wide operations instead of one);
* ``maxraw`` -- ``fma`` plus the block max taken over the raw product and scaled per row
  (``max_j(c * s_j) = c * max_j(s_j)``, c > 0), one tile-wide multiply fewer.

and two hand-written reference points without warp specialisation (no masks, whole
blocks): ``mini`` -- ``bench/ws_probe/mini_fa.py``, a from-scratch FA forward with
descriptors on the device; ``pipe`` -- the same loop software-pipelined by hand: the next
key block's score product is issued before this block's softmax, so the tensor cores
can run it while the softmax runs (FlashAttention-3's intra-warpgroup overlap).
Every kernel is checked against SDPA; SDPA (cuDNN) is timed in the same process.  One
JSON per line in ``DIR/probe.jsonl``.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from backward_probe import call_args, load_kernel, open_probe  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

CPU = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if CPU else "cuda"
SOURCES = Path(__file__).resolve().parent / "results" / "prefill_kernels_s14"
B, H, S, D = 1, 32, 8192, 128
LOG2E = 1.4426950408889634
# (row block, key block, warps, stages, descriptors)
CONFIGS = [(128, 64, 8, 3, False), (128, 128, 8, 2, False), (128, 64, 8, 3, True),
           (128, 128, 8, 2, True), (128, 128, 8, 3, True), (128, 64, 4, 3, False),
           (128, 128, 4, 2, True), (64, 64, 4, 3, False), (128, 128, 8, 3, False),
           (128, 64, 8, 4, True), (128, 64, 8, 4, False)]


def _fma(code: str) -> str:
    """``tY = (tA - m) * log2e`` -> one multiply-add from the product tA is scaled from."""
    scale = dict(re.findall(r"\n +(t\d+) = (t\d+ \* [0-9.e+-]+)\n", code))

    def one(m):
        ind, y, a = m.group(1), m.group(3), m.group(2)
        src = scale.get(a)
        if src and src.startswith("t") and " * " in src:  # tA = tP * c: fold c into log2e
            p, c = src.split(" * ")
            return f"{ind}{y} = {p} * {float(c) * LOG2E!r} - (mx_new * {LOG2E!r})[:, None]\n"
        return f"{ind}{y} = {a} * {LOG2E!r} - (mx_new * {LOG2E!r})[:, None]\n"
    return re.sub(r"( +)t\d+ = (t\d+) - mx_new\[:, None\]\n +(t\d+) = t\d+ \* 1\.4426950408889634\n",
                  one, code)


def _maxraw(code: str) -> str:
    """The block max of ``tA = tP * c`` taken over tP, then scaled by c (c > 0)."""
    scale = dict(re.findall(r"\n +(t\d+) = (t\d+ \* [0-9.e+-]+)\n", code))

    def one(m):
        src = scale.get(m.group(2))
        if not src:
            return m.group(0)
        p, c = src.split(" * ")
        assert float(c) > 0
        return f"{m.group(1)}tl.max(tl.where(mask_L[None, :], {p}, -1e+30), axis=1) * {c}"
    return re.sub(r"(= )tl\.max\(tl\.where\(mask_L\[None, :\], (t\d+), -1e\+30\), axis=1\)", one, code)


@triton.jit
def pipe_fa(Q, K, V, O, qk_scale, N: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
            BN: tl.constexpr, DEPTH: tl.constexpr, TMA: tl.constexpr):
    """FA forward with the score product of block j+1 issued before block j's softmax."""
    row0 = tl.program_id(0) * BM
    off = tl.program_id(1) * N * D
    rows = row0 + tl.arange(0, BM)
    cols = tl.arange(0, BN)
    dims = tl.arange(0, D)
    if TMA:
        qd = tl.make_tensor_descriptor(Q + off, shape=[N, D], strides=[D, 1], block_shape=[BM, D])
        kd = tl.make_tensor_descriptor(K + off, shape=[N, D], strides=[D, 1], block_shape=[BN, D])
        vd = tl.make_tensor_descriptor(V + off, shape=[N, D], strides=[D, 1], block_shape=[BN, D])
        q = qd.load([row0, 0])
        k0 = kd.load([0, 0])
    else:
        q = tl.load(Q + off + rows[:, None] * D + dims[None, :])
        k0 = tl.load(K + off + cols[:, None] * D + dims[None, :])
    s = tl.dot(q, tl.trans(k0))
    run_max = tl.full([BM], float("-inf"), tl.float32)
    run_sum = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    for start in tl.range(BN, N + BN, BN, num_stages=DEPTH):
        nxt = tl.minimum(start, N - BN)  # the last trip recomputes a block, unused
        if TMA:
            k = kd.load([nxt, 0])
            v = vd.load([start - BN, 0])
        else:
            k = tl.load(K + off + (nxt + cols)[:, None] * D + dims[None, :])
            v = tl.load(V + off + (start - BN + cols)[:, None] * D + dims[None, :])
        s_next = tl.dot(q, tl.trans(k))
        new_max = tl.maximum(run_max, tl.max(s, axis=1) * qk_scale)
        p = tl.exp2(s * qk_scale - new_max[:, None])
        shrink = tl.exp2(run_max - new_max)
        run_sum = run_sum * shrink + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * shrink[:, None])
        run_max = new_max
        s = s_next
    out = (acc / run_sum[:, None]).to(O.dtype.element_ty)
    tl.store(O + off + rows[:, None] * D + dims[None, :], out)


def source(kernel: str, variant: str) -> str:
    text = (SOURCES / f"{kernel}.py.txt").read_text()
    code = text[text.index("import triton\n"):]
    if variant in ("fma", "maxraw"):
        code = _fma(code)
    if variant == "maxraw":
        code = _maxraw(code)
    if variant != "base" and code == text[text.index("import triton\n"):] and kernel == "causal":
        raise AssertionError(f"the {variant} transform changed nothing in {kernel}")
    return code


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--kernels", default="global,causal,mini")
    ap.add_argument("--variants", default="base,fma,maxraw")
    ap.add_argument("--configs", default="", help="indices into CONFIGS (default all)")
    a = ap.parse_args()
    import torch
    from triton.testing import do_bench
    out = Path(a.out)
    emit, log = open_probe(out)
    (out / "src").mkdir(exist_ok=True)
    s = 256 if CPU else S
    torch.manual_seed(0)
    dt = torch.float32 if CPU else torch.float16
    q, k, v = (torch.randn(B, H, s, D, device=DEV, dtype=dt) for _ in range(3))
    ref = {c: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=c)
           for c in (False, True)}
    flops = 4 * B * H * s * s * D
    if not CPU:
        for c in (False, True):
            ms = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=c), return_mode="median")
            emit({"kernel": "sdpa", "causal": c, "ms": ms, "tflops": flops / (2 if c else 1) / ms / 1e9})
    configs = [CONFIGS[int(n)] for n in a.configs.split(",")] if a.configs else CONFIGS
    jobs = []  # (name, fn, cfg, causal)
    for kernel in a.kernels.split(","):
        if kernel == "mini":
            sys.path.insert(0, str(Path(__file__).resolve().parent / "ws_probe"))
            from mini_fa import mini_fa
            jobs += [("mini", mini_fa, c, False) for c in configs if c[4]]
            continue
        if kernel == "pipe":
            jobs += [("pipe", pipe_fa, c, False) for c in configs]
            continue
        for variant in a.variants.split(","):
            code = source(kernel, variant)
            if CPU:  # the interpreter's fp16 dots: check the transforms in fp32
                code = code.replace("tl.float16", "tl.float32").replace("8192", str(s))
            fn = load_kernel(f"probe_{kernel}_{variant}", code, out / "src")
            jobs += [(f"{kernel}_{variant}", fn, c, kernel == "causal") for c in configs]

    def bind(name, fn, cfg):
        o = torch.empty_like(q)
        if name in ("mini", "pipe"):
            bi, bl, w, st, tma = cfg
            args = [q, k, v, o, D ** -0.5 * LOG2E]
            consts = dict(N=s, D=D, BM=bi, BN=bl, DEPTH=st)
            consts.update(WSP=False) if name == "mini" else consts.update(TMA=tma and not CPU)
            return o, args, consts, dict(num_warps=w, num_stages=st), (s // bi, B * H)
        args, consts, opts = call_args(fn, {"q": q, "k": k, "v": v, "o": o}, s, cfg[:4], cfg[4])
        return o, args, consts, opts, (triton.cdiv(s, cfg[0]), B * H)

    def compile_one(job):
        name, fn, cfg, _ = job
        if CPU:
            return {}
        _, args, consts, opts, grid = bind(name, fn, cfg)
        t0 = time.perf_counter()
        try:
            ck = fn.warmup(*args, grid=grid, **consts, **opts)
            ck._init_handles()
            return {"n_regs": ck.n_regs, "n_spills": ck.n_spills, "shared": ck.metadata.shared,
                    "compile_s": round(time.perf_counter() - t0, 1)}
        except Exception as e:  # noqa: BLE001 - record and go on
            return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    with ThreadPoolExecutor(16) as pool:
        infos = list(pool.map(compile_one, jobs))

    def measure(name, fn, cfg, causal) -> dict:
        """Check one compiled kernel against SDPA, then time it (GPU only)."""
        o, args, consts, opts, grid = bind(name, fn, cfg)
        if CPU:
            consts["TMA"] = False
        run = lambda: fn[grid](*args, **consts, **opts)  # noqa: E731
        run()
        res = {"max_err": (o.float() - ref[causal].float()).abs().max().item()}
        if not CPU:
            res["ms"] = do_bench(run, return_mode="median")
            res["tflops"] = flops / (2 if causal else 1) / res["ms"] / 1e9
        return res
    for job, info in zip(jobs, infos):
        row = {"kernel": job[0], "causal": job[3], "cfg": list(job[2]), **info}
        if "error" not in info:
            try:
                row.update(measure(*job))
            except Exception as e:  # noqa: BLE001 - record and go on
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        emit(row)
    return log.close()

if __name__ == "__main__":
    sys.exit(main())
