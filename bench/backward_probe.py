"""GPU probe: where the fused backward (dK/dV with dQ added atomically) loses its time.

    python bench/backward_probe.py --out DIR [--kernels kv,q,fused] [--seq 8192]

Runs the backward kernels neptune_eq generated for plain attention (the sources saved in
``bench/results/backward_kernels_s12/``) directly through Triton -- no neptune_eq runtime,
so it needs no egglog -- over a grid of tile configs, and variants of the fused kernel
made by string transforms of its source:

* ``fused``      -- as generated: dQ's tile added per element (``tl.atomic_add``);
* ``fused_red``  -- dQ's tile added by one bulk tensor-memory reduce (``desc.atomic_add``
  on a device-side tensor descriptor, ``cp.reduce.async.bulk.tensor``; FlashAttention-3's
  dQ accumulation);
* ``fused_nodq`` -- the fused kernel with dQ's product but no store (what the adds cost);
* ``kv`` / ``q`` -- the two-kernel form (dK/dV in a loop over queries, dQ over keys).

bf16, B=2, H=16, D=128 (issue 18's shape).  Each variant's gradients are compared with
PyTorch's flash backward; cuDNN's and flash's backward are timed in the same process.
One JSON per line in ``DIR/probe.jsonl``.  A kernel that faults takes the CUDA context
with it, so run a risky variant in a process of its own (``--kernels fused_red``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# under TRITON_INTERPRET=1: a CPU check of the transforms and the argument binding only
CPU = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if CPU else "cuda"
SOURCES = Path(__file__).resolve().parent / "results" / "backward_kernels_s12"
B, H, D = 2, 16, 128
FILES = {"kv": "structure0_k_v", "q": "structure0_q", "fused": "structure0_k_v_q"}
# (row block, query/key loop block, warps, stages)
CONFIGS = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 4, 3), (128, 32, 8, 3), (128, 32, 4, 5),
           (128, 64, 4, 3), (64, 64, 4, 3), (64, 128, 4, 2), (128, 128, 8, 2), (64, 64, 8, 3)]


def source(kind: str) -> str:
    text = (SOURCES / f"{FILES[kind.split('_')[0]]}.py.txt").read_text()
    code = text[text.index("import triton\n"):]
    atomic = re.search(r"\n( +)tl\.atomic_add\(d_q_ptr.*\n", code)
    if kind in ("fused_red", "fused_redptr"):  # one bulk reduce per tile
        # (fused_red: where descriptors are on; fused_redptr: always, loads by pointers)
        ind = atomic.group(1)
        cond = "TMA" if kind == "fused_red" else "True"
        desc = (f"    if {cond}:\n        d_q_red = tl.make_tensor_descriptor(d_q_ptr + ax_z * d_q_s0 + "
                f"ax_y * d_q_s1, shape=[n_L, 128], strides=[d_q_s2, 1], block_shape=[B_L, B_q3])\n")
        code = code.replace("    d_v = tl.zeros(", desc + "    d_v = tl.zeros(", 1)
        code = code.replace(atomic.group(0), f"\n{ind}if {cond}:\n{ind}    d_q_red.atomic_add([l0, 0], t19)\n"
                            f"{ind}else:\n{ind}    {atomic.group(0).strip()}\n")
    elif kind == "fused_nodq":  # the product stays (kept alive by a data-dependent no-op)
        ind = atomic.group(1)
        code = code.replace(atomic.group(0), f"\n{ind}if tl.sum(tl.sum(t19, 1), 0) == 12345.678:\n"
                            f"{ind}    {atomic.group(0).strip()}\n")
    # the interpreter's bf16 dots are wrong when called directly (neptune_eq lowers
    # them for it in fp32): the CPU check runs fp32
    return code.replace("tl.bfloat16", "tl.float32") if CPU else code


def load(kind: str, tmp: Path):
    return load_kernel(f"probe_{kind}", source(kind), tmp)


def load_kernel(name: str, code: str, tmp: Path):
    """The ``neptune_kernel`` of ``code``, written to ``tmp/<name>.py`` and imported (Triton
    needs a real file to read a kernel's source from)."""
    import importlib.util
    path = tmp / f"{name}.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.neptune_kernel


def open_probe(out: Path):
    """(emit, log): ``emit(row)`` prints a row and appends it to ``out/probe.jsonl``; on a
    GPU, Triton gets the allocator that device-side tensor descriptors take scratch from."""
    import torch
    import triton
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "probe.jsonl", "a")

    def emit(row):
        print(json.dumps(row), flush=True)
        log.write(json.dumps(row) + "\n")
        log.flush()
    if not CPU:
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                 device=DEV))
    return emit, log


def call_args(fn, tensors: dict, S: int, cfg, tma: bool):
    """Positional arguments (by the generated parameter names) and constexprs."""
    bi, bl, w, st = cfg
    args, consts = [], {}
    for p in fn.arg_names:
        if p.endswith("_ptr"):
            args.append(tensors[p[:-4]])
        elif re.fullmatch(r".+_s\d", p):
            args.append(tensors[p[:-3]].stride(int(p[-1])))
        elif p == "n_B":
            args.append(B)
        elif p in ("n_L", "n_S"):
            args.append(S)
        elif p in ("B_j", "B_i"):
            consts[p] = bi
        elif p == "B_L":
            consts[p] = bl
        elif p.startswith("B_"):
            consts[p] = D
        elif p.startswith("EVEN_"):
            consts[p] = True
        elif p == "TMA":
            consts[p] = tma
        elif p == "WS":
            consts[p] = False
        elif p == "LOOP_STAGES":
            consts[p] = st
        elif p in ("VDOT", "ONE_LOOP"):
            consts[p] = False
        else:
            raise KeyError(p)
    return args, consts, dict(num_warps=w, num_stages=st)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--kernels", default="kv,q,fused,fused_nodq")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--configs", default="", help="indices into CONFIGS (default all)")
    ap.add_argument("--tma", default="both", choices=("both", "on", "off"))
    ap.add_argument("--peers", action="store_true", help="also time cuDNN's and flash's backward")
    a = ap.parse_args()
    import torch
    import triton
    from triton.testing import do_bench
    out = Path(a.out)
    emit, log = open_probe(out)
    S = a.seq
    torch.manual_seed(0)
    dtype = torch.float32 if CPU else torch.bfloat16
    q, k, v, d_o = (torch.randn(B, H, S, D, device=DEV, dtype=dtype) for _ in range(4))
    if CPU:
        sc = (q.float() @ k.float().transpose(-1, -2)) / D ** 0.5
        lse = sc.logsumexp(-1)
        o = (sc.softmax(-1) @ v.float()).to(q.dtype)
    else:
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[:2]
    tensors = {"q": q, "k": k, "v": v, "o": o, "d_o": d_o, "mx": lse.float().contiguous(),
               "g_den_1": -(d_o.float() * o.float()).sum(-1)}
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    flops = 2.5 * 4 * B * H * S * S * D
    from torch.nn.attention import SDPBackend, sdpa_kernel
    ref = {}
    for name, backend in (("flash", SDPBackend.MATH if CPU else SDPBackend.FLASH_ATTENTION),
                          ("cudnn", SDPBackend.MATH if CPU else SDPBackend.CUDNN_ATTENTION)):
        with sdpa_kernel(backend):
            y = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr)
        grads = torch.autograd.grad(y, (qr, kr, vr), d_o, retain_graph=True)
        if name == "flash":
            ref = dict(zip(("d_q", "d_k", "d_v"), grads))
        if a.peers:
            ms = do_bench(lambda: torch.autograd.grad(y, (qr, kr, vr), d_o, retain_graph=True),
                          return_mode="median")
            emit({"kernel": name, "S": S, "ms": ms, "tflops": flops / ms / 1e9})
    tmp = out / "src"
    tmp.mkdir(exist_ok=True)
    for kind in a.kernels.split(","):
        fn = load(kind, tmp)
        configs = [CONFIGS[int(n)] for n in a.configs.split(",")] if a.configs else CONFIGS
        tmas = {"both": (False, True), "on": (True,), "off": (False,)}[a.tma]
        cands = [(c, t) for c in ([(16, 16, 4, 1)] if CPU else configs)
                 for t in ((True,) if kind == "fused_red" else tmas)]

        def outputs():
            res = {}
            if kind in ("kv",) or kind.startswith("fused"):
                res["d_k"] = torch.empty_like(k)
                res["d_v"] = torch.empty_like(v)
            if kind == "q":
                res["d_q"] = torch.empty_like(q)
                res["g_den_1"] = torch.empty(B, H, S, device=DEV)
            elif kind.startswith("fused"):
                res["d_q"] = torch.zeros(B, H, S, D, device=DEV)
            return res

        def compile_one(ct):
            cfg, tma = ct
            res = outputs()
            args, consts, opts = call_args(fn, {**tensors, **res}, S, cfg, tma)
            grid = (triton.cdiv(S, cfg[0]), B * H)
            if CPU:
                return {}
            t0 = time.perf_counter()
            try:
                ck = fn.warmup(*args, grid=grid, **consts, **opts)
                return {"compiled": ck, "compile_s": round(time.perf_counter() - t0, 1)}
            except Exception as e:  # noqa: BLE001 - record and go on
                return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        with ThreadPoolExecutor(16) as pool:
            infos = list(pool.map(compile_one, cands))
        for (cfg, tma), info in zip(cands, infos):
            ck = info.pop("compiled", None)
            if ck is not None and not CPU:
                ck._init_handles()
                info.update(n_regs=ck.n_regs, n_spills=ck.n_spills, shared=ck.metadata.shared)
            row = {"kernel": kind, "S": S, "cfg": list(cfg), "tma": tma, **info}
            if "error" not in info:
                try:
                    res = outputs()
                    args, consts, opts = call_args(fn, {**tensors, **res}, S, cfg, tma)
                    grid = (triton.cdiv(S, cfg[0]), B * H)

                    def run():
                        if "d_q" in res and kind.startswith("fused"):
                            res["d_q"].zero_()
                        fn[grid](*args, **consts, **opts)
                    run()
                    if not CPU:
                        torch.cuda.synchronize()
                    checked = ("d_k", "d_v") if kind == "fused_nodq" else ("d_q", "d_k", "d_v")
                    row["max_err"] = {n: (res[n].float() - ref[n].float()).abs().max().item()
                                      for n in checked if n in res}
                    row["ms"] = 0.0 if CPU else do_bench(run, return_mode="median")
                    row["tflops_of_kernel"] = 0.0 if CPU else (flops * {"kv": 4, "q": 3}.get(kind, 5) / 5
                                               / row["ms"] / 1e9)
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            emit(row)
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
