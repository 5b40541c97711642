"""ne.flex_attention on the GPU next to torch's flex_attention (compiled) and SDPA, same
process: correctness at several lengths of one structure, and time per call.

    python bench/flex_dropin_gpu.py      # writes bench/results/flex_dropin_gpu.json
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import neptune_eq as ne  # noqa: E402


def causal(b, h, q, kv):
    return q >= kv


def softcap(score, b, h, q, kv):
    return torch.tanh(score / 30) * 30


def main():
    flex = torch.compile(flex_attention, dynamic=True)
    rows = []
    for S in (1000, 2048, 4099):
        q, k, v = (torch.randn(1, 16, S, 128, device="cuda", dtype=torch.float16) for _ in range(3))
        bm = create_block_mask(causal, None, None, S, S, device="cuda")
        for name, kw in (("causal", {"block_mask": bm}), ("causal+softcap", {"block_mask": bm, "score_mod": softcap})):
            t0 = time.perf_counter()
            ours = ne.flex_attention(q, k, v, **kw)
            first = time.perf_counter() - t0
            ref = flex(q, k, v, **kw)
            sd = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True) \
                if name == "causal" else None
            row = {"op": name, "S": S, "first_call_s": first,
                   "max_abs_diff_vs_flex": (ours.float() - ref.float()).abs().max().item(),
                   "ms_ours": do_bench(lambda: ne.flex_attention(q, k, v, **kw), return_mode="median"),
                   "ms_flex": do_bench(lambda: flex(q, k, v, **kw), return_mode="median")}
            if sd is not None:
                row["max_abs_err_vs_fp32_sdpa"] = (ours.float() - sd).abs().max().item()
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
           "structures": len(ne.flex.STRUCTURES) if hasattr(ne, "flex") else None}
    Path(__file__).parent.joinpath("results", "flex_dropin_gpu.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
