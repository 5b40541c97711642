"""Is the special-function unit (MUFU: ex2) what bounds attention's block math? (issue 16)

At head dim 64 the two products of a 128x128 key block take about as many cycles as its
16384 ex2 at 16 a cycle per SM, so softmax can bound the loop where the tensor cores
could go faster.  FlashAttention-4 computes part of its exponentials on the FMA units
instead: 2^x = 2^floor(x) * p(frac x), p a cubic (relative error 1.1e-4, under fp16's
rounding of P).  This probe swaps the generated code's ``tl.exp2`` on score tiles for

* ``mufu``  -- ``tl.exp2`` (the generator's own; the baseline),
* ``poly``  -- the cubic everywhere (all on the FMA units),
* ``split`` -- the cubic on every second column, ``tl.exp2`` on the others (the tile
  reshaped to [rows, cols/2, 2] and split: each thread of a wgmma accumulator holds
  column pairs, so no data moves),
* ``poly2`` / ``split2`` -- the same without a float-to-int conversion (which shares the
  special-function unit's issue rate): x rounded by adding 1.5 * 2^23, whose low bits are
  then the integer, shifted into the exponent; the cubic on [-1/2, 1/2] (FA-4's form),

superoptimizes each (no cache; every tile config timed by the chooser as usual) and times
the chosen kernel beside cuDNN in the same process.  A form that does not compile shows as
a failed config in the row's ``timings``.

    python bench/probe/exp2_forms_probe.py [--forms mufu poly split] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import neptune_eq as ne  # noqa: E402
from neptune_eq.lowering import codegen  # noqa: E402

# (batch, q heads, kv heads, S, head dim, causal)
SETUPS = [(4, 16, 16, 5000, 64, True), (4, 16, 8, 3000, 64, True),
          (1, 32, 32, 8192, 128, False), (1, 32, 32, 8192, 128, True)]
# 2^x = 2^floor(x) * p(x - floor(x)), p(0) = 1, p(1) = 2; x clamped at -126 (a masked
# score's x is about -1e30: 2^-126 is 1e-38, which P's fp16/bf16 rounding makes 0)
POLY = ("(((1.0 + {f} * (0.6955020102552258 + {f} * (0.22626981564297854 + {f} * "
        "0.07822817410179561))).to(tl.int32, bitcast=True) + ({i}.to(tl.int32) << 23))"
        ".to(tl.float32, bitcast=True))")
# 2^x = 2^j * q(x - j), j = round(x) read off the bits of x + 1.5 * 2^23 (no conversion)
POLY2 = ("((0.9999513386570443 + {f} * (0.6932530549963503 + {f} * (0.24225698192661124 + "
         "{f} * 0.055029266451518254))).to(tl.int32, bitcast=True) + "
         "({t}.to(tl.int32, bitcast=True) << 23)).to(tl.float32, bitcast=True)")
_REAL = codegen.Emitter._expr


def _poly(em, x: str, scope: int, magic: bool = False) -> str:
    if magic:
        c, t, f = em.new(), em.new(), em.new()
        em.emit(f"{c} = tl.maximum({x}, -126.0)", scope)
        em.emit(f"{t} = {c} + 12582912.0", scope)
        em.emit(f"{f} = {c} - ({t} - 12582912.0)", scope)
        return POLY2.format(f=f, t=t)
    c, i, f = em.new(), em.new(), em.new()
    em.emit(f"{c} = tl.maximum({x}, -126.0)", scope)
    em.emit(f"{i} = tl.floor({c})", scope)
    em.emit(f"{f} = {c} - {i}", scope)
    return POLY.format(f=f, i=i)


def patched(form: str):
    def _expr(self, t, scope):
        if t.op != "exp2" or form == "mufu":
            return _REAL(self, t, scope)
        a = self.float_of(self.expr(t.args[0]))
        if len(a.axes) != 2:   # the row correction exp2(m_old - m_new): 1 per row
            return _REAL(self, t, scope)
        x = self.new()
        self.emit(f"{x} = {a.code}", scope)
        magic = form.endswith("2")
        if form.startswith("poly"):
            return self.bind(_poly(self, x, scope, magic), a.axes, a.kind, scope)
        r, ea, eb = self.new(), self.new(), self.new()
        self.emit(f"{r} = tl.reshape({x}, ({x}.shape[0], {x}.shape[1] // 2, 2))", scope)
        self.emit(f"{ea}, {eb} = tl.split({r})", scope)
        pb = self.new()
        self.emit(f"{pb} = {_poly(self, eb, scope, magic)}", scope)
        return self.bind(f"tl.reshape(tl.join(tl.exp2({ea}), {pb}), ({x}.shape[0], {x}.shape[1]))",
                         a.axes, a.kind, scope)
    return _expr


def run(setup, form: str, dtype: str) -> dict:
    b, hq, hkv, s, d, causal = setup
    torch.manual_seed(0)
    tdt = getattr(torch, dtype)
    q = torch.randn(b, hq, s, d, device="cuda", dtype=tdt)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=tdt)
    v = torch.randn_like(k)
    codegen.Emitter._expr = patched(form)
    try:
        prog = ne.attention(b, hq, s, s, d, dtype, kv_heads=hkv,
                            mask_mod=(lambda bb, h, i, j: j <= i) if causal else None)
        t0 = time.perf_counter()
        kern = ne.superoptimize(prog, target="cuda", top_k=2, cache=False)
        cold = time.perf_counter() - t0
    finally:
        codegen.Emitter._expr = _REAL
    work = 4 * b * hq * s * s * d / (2 if causal else 1) / 1e12
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv)
        cudnn = work / (do_bench(lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=hq != hkv), warmup=25, rep=100,
            return_mode="median") / 1e3)
    out = kern(q, k, v)
    ours = work / (do_bench(lambda: kern(q, k, v), warmup=25, rep=100, return_mode="median") / 1e3)
    row = dict(setup=setup, form=form, dtype=dtype, ours_tflops=ours, cudnn_tflops=cudnn,
               vs_cudnn=ours / cudnn, max_diff_vs_cudnn=(out.float() - ref.float()).abs().max().item(),
               config=str(kern.config), cold_s=round(cold, 1),
               timings=[(str(c), None if ms is None else round(ms * 1e3, 1), (err or "")[:160])
                        for c, ms, err in kern.timings])
    print(f"{str(setup):34s} {form:6s} ours {ours:6.1f} cuDNN {cudnn:6.1f} ({ours / cudnn:.3f}x) "
          f"diff {row['max_diff_vs_cudnn']:.1e} [{row['config']}]", flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--forms", nargs="+", default=["mufu", "poly", "split"])
    ap.add_argument("--setups", type=int, nargs="+", default=list(range(len(SETUPS))))
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--out", default="bench/results/exp2_forms_probe.json")
    a = ap.parse_args()
    rows = []
    for i in a.setups:
        for form in a.forms:
            try:
                rows.append(run(SETUPS[i], form, a.dtype))
            except Exception as e:  # noqa: BLE001 - a form that fails is a finding
                print(f"{SETUPS[i]} {form}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                rows.append(dict(setup=SETUPS[i], form=form, error=f"{type(e).__name__}: {e}"[:600]))
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(),
                                                   torch=torch.__version__, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
