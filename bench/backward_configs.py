"""Every tile config of every backward kernel, timed on the call's own tensors: the fused
form (dQ added atomically inside dK/dV's loop, after a row-statistics kernel) against the
two-kernel form (``torch.use_deterministic_algorithms``: dQ's loop over keys, dK/dV's
over queries), kernel by kernel, so a gap between the forms can be traced to a kernel
and a config -- and to whether the atomics or the tile shape cost it.

    python bench/backward_configs.py [--variants plain causal] [--S 8192] [--out DIR]

Writes backward_configs.{json,md}.  bf16, B=2, H=16, D=128 (issue 18's goal shapes).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import neptune_eq as ne  # noqa: E402
from neptune_eq.api import Kernel, _random_inputs  # noqa: E402
from neptune_eq.dropin import flex  # noqa: E402
from neptune_eq.runtime.launcher import candidate_configs, time_configs  # noqa: E402
from neptune_eq.sizes import bind, sizes_of  # noqa: E402

B, H, D = 2, 16, 128
MASKS = {"plain": None, "causal": lambda b, h, i, j: j <= i}


def calls_of_one_step(variant: str, S: int, deterministic: bool) -> dict:
    """Run one fwd+bwd; the backward kernels it called, with the arguments they got."""
    seen: dict[int, tuple] = {}
    original = Kernel.__call__

    def spy(self, *args, **kw):
        seen[id(self)] = (self, args)
        return original(self, *args, **kw)
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    Kernel.__call__ = spy
    try:
        out = ne.flex_attention(q, k, v, mask_mod=MASKS[variant])
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
    finally:
        Kernel.__call__ = original
        torch.use_deterministic_algorithms(False)
    backward = {id(kern): "+".join(wrt) + (" (row statistics)" if pre and kern is pre[1] else "")
                for st in flex.STRUCTURES.values()
                for (wrt, *_), (_, main, _, _, _, pre) in st.backward.items()
                for kern in ([main] + ([pre[1]] if pre else []))}
    return {backward[i]: call for i, call in seen.items() if i in backward}


def time_kernel(kern: Kernel, args: tuple) -> list[dict]:
    r = kern.chosen_row
    names = [ph.name for ph in kern.input_program.inputs]
    values = sizes_of(kern.input_program, dict(zip(names, args)))
    # (the call's inputs; outputs allocated at the call's sizes)
    tensors = _random_inputs(bind(r.program, values) if values else r.program,
                             dict(zip(names, args)))
    configs = candidate_configs(r.kernel, "cuda")
    rows = []
    for cfg, ms, status in time_configs(r.program, r.kernel, "cuda", tensors, configs,
                                        values=values, host=True):
        rows.append({"config": str(cfg), "ms": ms, "status": status,
                     "chosen": str(cfg) == str(kern.config)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", nargs="+", default=["plain", "causal"])
    ap.add_argument("--S", type=int, default=8192)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    a = ap.parse_args()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "command": "python bench/backward_configs.py " + " ".join(sys.argv[1:]), "rows": []}
    lines = [f"# Backward kernels, every tile config ({out['device']}, bf16, B={B} H={H} "
             f"D={D}, S={a.S})", "", f"`{out['command']}`", "",
             "| variant | form | kernel | config | ms | chosen |", "|---|---|---|---|---|---|"]
    for variant in a.variants:
        for det in (False, True):
            form = "two kernels (deterministic)" if det else "fused (atomic dQ)"
            for name, (kern, args) in calls_of_one_step(variant, a.S, det).items():
                for row in time_kernel(kern, args):
                    row.update(variant=variant, form=form, kernel=name)
                    out["rows"].append(row)
                    ms = f"{row['ms']:.3f}" if row["ms"] else row["status"][:60]
                    lines.append(f"| {variant} | {form} | {name} | {row['config']} | {ms} | "
                                 f"{'yes' if row['chosen'] else ''} |")
                    print(lines[-1], flush=True)
                    write(Path(a.out), out, lines)  # after every row: a cut-off run keeps it
    write(Path(a.out), out, lines)


def write(res: Path, out: dict, lines: list[str]) -> None:
    res.mkdir(parents=True, exist_ok=True)
    (res / "backward_configs.json").write_text(json.dumps(out, indent=1))
    (res / "backward_configs.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
