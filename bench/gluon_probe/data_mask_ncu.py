"""Probe (session 49): one data-mask call's kernels launched a few times, for Nsight Compute.

``bench/doc_mask_gpu.py``'s cases (and ``causal``: the same heads and length under the
affine mask q >= kv, the plain causal form the data-mask forms are measured against),
built through ``ne.flex_attention`` as a call builds them (``doc_mask_gpu.launcher_of``)
and launched as the product launches them.  Run it once without ncu to fill the cache
(``NEPTUNE_EQ_CACHE``), so that under ncu the cold choice's timing launches are not
there; then, e.g.:

    ncu --clock-control none --kernel-name regex:_ws --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        python bench/gluon_probe/data_mask_ncu.py jagged 32768
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import torch  # noqa: E402

import doc_mask_gpu as dm  # noqa: E402


def main():
    name, S = sys.argv[1], int(sys.argv[2])
    if name == "causal":
        B, mask = 1, (lambda b, h, q, kv: q >= kv)
    else:
        mask, B, _ = dm.case(name, S)
    q, k, v = (torch.randn(B, dm.H, S, dm.D, device="cuda", dtype=torch.float16)
               for _ in range(3))
    kern, la, bound = dm.launcher_of(q, k, v, mask)
    print(f"{name} S={S}: {getattr(la, 'config', None)}", flush=True)
    for _ in range(4):
        la(bound)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
