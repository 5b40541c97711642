"""What a cold choice leaves untimed, and the measurements that say so
(``runtime.tile_configs.GRID_EVIDENCE``):

    python bench/grid_evidence.py   # reads bench/results/**/*.json, writes bench/results/grid_evidence.md

1. The decode grid of ``runtime.tile_configs.candidate_configs``.  Every config offered in
   a ``bench/decode_configs.py`` run is timed cold (K/V from DRAM, on the GPU alone: the
   time ``choose`` picks by).  Per case (file, operator, length) each config's speed is
   taken relative to the case's best; a kind of config is worth compiling only if it is
   the best somewhere.
2. Split-k candidates of a prefill (``choosing.choose.choose``).  Every
   ``bench/neptune_ops.py`` row records each timed candidate's best time; where a prefill
   timed both the rolling and the split-k candidate, their ratio.
"""
from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
PACKED = {"gqa-dc": 8, "softcap-dc": 2}  # rows a program packs (heads of a KV group)


def fields(cfg: str) -> dict:
    num = lambda k: int(m.group(1)) if (m := re.search(rf"{k}=(\d+)", cfg)) else 0  # noqa: E731
    return {"keys": num("B_L"), "warps": num("warps"), "splits": num("splits"),
            "one_launch": "one-launch" in cfg, "tma": " tma" in cfg,
            "cuda_cores": "cuda-cores" in cfg}


def kinds(op: str, f: dict) -> list[str]:
    """The pruned kinds a config belongs to (the ones ``candidate_configs`` drops)."""
    out = []
    if f["tma"]:
        out.append("tensor descriptors (TMA)")
    if f["one_launch"] and op in PACKED and not f["cuda_cores"]:
        out.append("one launch, packed rows")
    if f["splits"] == 2 and f["keys"] in (32, 64):
        out.append("split in two at 32 or 64 keys")
    if f["keys"] == 128 and f["warps"] == 8:
        out.append("128 keys at 8 warps")
    return out


def main() -> None:
    best_of = defaultdict(list)   # kind -> [(ratio, case)]
    loss = defaultdict(list)      # kind -> [(case's best without that kind / with it, case)]
    w8_vs_w4 = []                 # (8-warp speed / its 4-warp twin's, case)
    cases = 0
    files = sorted(RESULTS.glob("**/decode_configs*.json"))
    for path in files:
        data = json.loads(path.read_text())
        for row in data.get("rows", []):
            timed = [c for c in row.get("configs", []) if c.get("offered", True) and c.get("cold")]
            if not timed:
                continue
            cases += 1
            case = f"{path.relative_to(RESULTS)}: {row['op']} S={row['S']}"
            best = max(c["cold"] for c in timed)
            by_cfg = {c["config"]: c["cold"] for c in timed}
            for k in {k for c in timed for k in kinds(row["op"], fields(c["config"]))}:
                rest = [c["cold"] for c in timed if k not in kinds(row["op"], fields(c["config"]))]
                loss[k].append((max(rest) / best if rest else 0.0, case))
            # (all kinds left out at once: what the pruned grid would have chosen)
            rest = [c["cold"] for c in timed if not kinds(row["op"], fields(c["config"]))]
            loss["all four"].append((max(rest) / best if rest else 0.0, case))
            for c in timed:
                f = fields(c["config"])
                for k in kinds(row["op"], f):
                    best_of[k].append((c["cold"] / best, case))
                if f["keys"] == 128 and f["warps"] == 8:
                    twin = c["config"].replace("warps=8 stages=4", "warps=4 stages=3")
                    if twin in by_cfg:
                        w8_vs_w4.append((c["cold"] / by_cfg[twin], case))
    lines = ["# Decode tile configs against the best of their case", "",
             "`python bench/grid_evidence.py` over "
             f"{len(files)} `decode_configs` runs ({cases} cases: operator x length x run; "
             "H100 and H200, sessions 11-49). Speed = the config's cold TB/s (K/V from DRAM, "
             "GPU alone) / the best offered config's in the same case.", "",
             "| kind left out of the decode grid | timings | best speed vs the case's best | median "
             "| the case's best without the kind: worst case | where |",
             "| --- | --- | --- | --- | --- | --- |"]
    for k, vals in sorted(best_of.items()) + [("all four", [])]:
        worst = min(loss[k])
        if worst[0] >= 1.0:  # never the best of any case alone
            worst = (1.0, "never the only best")
        if not vals:
            lines.append(f"| {k} | | | | {worst[0]:.3f} | {worst[1]} |")
            continue
        vals.sort()
        lines.append(f"| {k} | {len(vals)} | {vals[-1][0]:.2f} | {vals[len(vals) // 2][0]:.2f} "
                     f"| {worst[0]:.3f} | {worst[1]} |")
    if w8_vs_w4:
        w8_vs_w4.sort()
        lines += ["", f"128 keys at 8 warps / the same config at 4 warps: at most {w8_vs_w4[-1][0]:.3f} "
                  f"({w8_vs_w4[-1][1]}), median {w8_vs_w4[len(w8_vs_w4) // 2][0]:.3f} over "
                  f"{len(w8_vs_w4)} pairs."]
    lines += [""] + split_k_prefill()
    (RESULTS / "grid_evidence.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def split_k_prefill() -> list[str]:
    """Prefill rows that timed a rolling and a split-k candidate: split-k's best time over
    the rolling one's."""
    ratios = []
    for path in sorted(RESULTS.glob("**/*.json")):
        try:
            data = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError):
            continue
        rows = data.get("rows") if isinstance(data, dict) else data
        for row in rows if isinstance(rows, list) else []:
            if not (isinstance(row, dict) and str(row.get("op", "")).endswith("-pf")
                    and row.get("candidates")):
                continue
            timed = [(c[0], c[2], c[3]) for c in row["candidates"] if c[3]]
            roll = [(p, m) for d, p, m in timed if d.startswith("rolling")]
            split = [(p, m) for d, p, m in timed if d.startswith("split-k")]
            if roll and split:
                ratios.append((min(m for _, m in split) / min(m for _, m in roll),
                               min(p for p, _ in split) / min(p for p, _ in roll),
                               f"{path.relative_to(RESULTS)}: {row['op']} S={row['S']}"))
    if not ratios:
        return []
    ratios.sort()
    return ["# Split-k candidates of a prefill against the rolling one", "",
            f"{len(ratios)} prefill rows of `bench/neptune_ops.py` runs timed both (global, causal, "
            "ALiBi, GQA, softcap and window prefill, S = 512-32768, H100 and H200). The split-k "
            f"candidate's best measured time / the rolling candidate's: at least {ratios[0][0]:.2f} "
            f"({ratios[0][2]}), median {ratios[len(ratios) // 2][0]:.2f}, at most {ratios[-1][0]:.2f}. "
            f"The cost model put it at {min(r[1] for r in ratios):.2f}-{max(r[1] for r in ratios):.2f}x: "
            "the rolling candidate's work plus a combine, but not that the rolling candidate also "
            "has the warp-specialised Gluon form and split-k writes every row's fold states."]


if __name__ == "__main__":
    main()
