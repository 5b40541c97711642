"""GPU check: a fwd+bwd of ne.flex_attention captured in a CUDA graph gives the gradients
the called step gives (and PyTorch's flash backward, for plain attention).

    python bench/gpu_validate_graph.py [--lengths 2048,8192] [--out DIR]

Per variant, length and mode (the timer's form; deterministic): the max abs difference of
each gradient between one graph replay and the called step, again after three more
replays (an output summed atomically that a replay does not zero grows), and against
flash's backward where it runs; which backward form the structure chose.  Writes
``graph_validate.json`` to --out.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from backward_gpu import B, D, H, capture_step, causal, softcap, step  # noqa: E402

import neptune_eq as ne  # noqa: E402
from neptune_eq.dropin import flex  # noqa: E402

VARIANTS = {"plain": {}, "causal": {"mask_mod": causal},
            "causal+softcap": {"mask_mod": causal, "score_mod": softcap}}
NAMES = ("dq", "dk", "dv")


def max_diffs(xs, ys) -> dict:
    """Max abs difference per gradient."""
    return {n: (a.float() - b.float()).abs().max().item() for n, a, b in zip(NAMES, xs, ys)}


def check(name: str, S: int, deterministic: bool) -> dict:
    kw = VARIANTS[name]
    fn = lambda q, k, v: ne.flex_attention(q, k, v, **kw)  # noqa: E731
    torch.manual_seed(0)
    row = {"variant": name, "S": S, "deterministic": deterministic}
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))
            g = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
            called = step(fn, q, k, v, g)
            graph, grads = capture_step(fn, q, k, v, g, warmups=2)
            graph.replay()
            torch.cuda.synchronize()
            row["graph_vs_called"] = max_diffs(grads, called)
            row["called_abs_max"] = {n: b.float().abs().max().item()
                                     for n, b in zip(NAMES, called)}
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            row["graph4_vs_called"] = max_diffs(grads, called)
            row["called_again_vs_called"] = max_diffs(step(fn, q, k, v, g), called)
            if name in ("plain", "causal"):
                qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    out = F.scaled_dot_product_attention(qr, kr, vr, is_causal=name == "causal")
                ref = torch.autograd.grad(out, (qr, kr, vr), g)
                row["called_vs_flash"] = max_diffs(called, ref)
                row["graph_vs_flash"] = max_diffs(grads, ref)
        torch.cuda.synchronize()
        # per structure traced so far: {(lse has a gradient, size bucket): (fused form chosen, timed there)}
        row["forms"] = [{str(k): v for k, v in s.backward_form.items()}
                        for s in flex.STRUCTURES.values()]
    except Exception as e:  # noqa: BLE001 - record and go on
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        torch.use_deterministic_algorithms(False)
    print(json.dumps(row), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    a = ap.parse_args()
    rows = []
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for S in (int(x) for x in a.lengths.split(",")):
        for name in a.variants.split(","):
            for det in (False, True):
                rows.append(check(name, S, det))
                (out / "graph_validate.json").write_text(json.dumps(
                    {"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
