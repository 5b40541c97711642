"""Shared test helpers: superoptimize, run in the interpreter, compare to the oracle."""
import torch

import neptune_eq as ne
from neptune_eq.interp import evaluate

_TOL = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 2e-2}


def random_inputs(program, scale: float = 1.0):
    return {ph.name: (torch.randn(ph.shape, dtype=torch.float64) * scale).to(getattr(torch, ph.dtype))
            for ph in program.inputs}


def check_kernel(out_tensor, scale: float = 1.0, **kw):
    """Superoptimize, run the kernel, and compare with the fp64 interpreter on the
    *input* program; returns the kernel."""
    kern = ne.superoptimize(out_tensor, target="interpreter", **kw)
    prog = kern.input_program
    ins = random_inputs(prog, scale)
    got = kern(**ins)
    ref = evaluate(prog, ins)[prog.outputs[0]]
    dt = prog.dtype_of(prog.outputs[0])
    err = (got.double() - ref).abs().max().item()
    bound = _TOL[dt] * max(1.0, ref.abs().max().item())
    assert torch.isfinite(got).all(), "kernel produced non-finite values"
    assert err <= bound, f"max error {err:.3e} > {bound:.3e}"
    return kern


def count_calls(monkeypatch, owner, name: str) -> list:
    """Wrap ``owner.name`` so each call is counted; the one-element list holds the count."""
    count = [0]
    real = getattr(owner, name)

    def counted(*a, **kw):
        count[0] += 1
        return real(*a, **kw)
    monkeypatch.setattr(owner, name, counted)
    return count


def filled_shapes(fn) -> list:
    """The shapes torch filled (``aten::fill_`` on a non-empty tensor) while ``fn()`` ran:
    under ``torch.use_deterministic_algorithms(True)`` every new tensor is filled."""
    with torch.profiler.profile(record_shapes=True) as prof:
        fn()
    return [e.input_shapes[0] for e in prof.events()
            if e.name == "aten::fill_" and e.input_shapes[0] not in ([0], [])]
