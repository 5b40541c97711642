"""Split-k plans: which tile plans a split-k kernel can run, and the split factors to time.

A pass holding a ``splitk`` fold is cut into chunks of its loop, each run by its own
program (the partials kernel), and a combine folds the chunks' states, re-based by each
fold's correction (``split_combine.combine_partials``).  Only the first pass is cut.  A later pass
runs whole in the combine, once its row block's states are final: the target's logit of
linear + cross-entropy, ``Σ_k x[i, k] w[k, t[i]]``, beside the vocabulary's log-sum-exp.
Before that was allowed, such a plan could not split, and at N=512, V=32003 its 4-32 row
programs ran 19x torch eager's time (H200, session 41).
"""
from __future__ import annotations

from ..ir import accessed

_COMBINABLE = ("sum", "max", "min", "rollsum", "rollmax", "splitk")


def why_not_splittable(tp) -> str | None:
    """Why split-k cannot run tile plan ``tp`` (a ``lower.TilePlan`` with a ``splitk``
    fold), or None when it can."""
    split = [k for k, ps in enumerate(tp.passes) if any(f.op == "splitk" for f in ps.folds)]
    if split != [0]:
        return ("A split-k fold must be in the first pass over memory and no other; this "
                f"plan has it in pass(es) {[k + 1 for k in split]}.")
    for ps in tp.passes[1:]:
        if ps.extent == tp.passes[0].extent:  # a second stream over the split loop, serial
            return ("A pass after the split one runs whole in the combine; one over the "
                    f"split loop's {ps.extent} again would undo the split.")
        if ps.scattered or ps.gate_atoms:
            return ("A pass after the split one runs whole in the combine, which has no "
                    "masks or scattered outputs.")
    for f in tp.passes[0].folds:
        if tp.block_axis not in f.state_axes and not _plain(f):
            return (f"A fold without the row axis {tp.block_axis} ({f.name}) is combined "
                    "from one row block's copy, so its correction may read no producer.")
        if f.op not in _COMBINABLE:
            return f"Cannot combine partials of a {f.op} fold ({f.name})."
    return None


def _plain(f) -> bool:
    """A fold whose partials combine without re-basing: a sum, max or min, or a split-k
    sum with a correction that reads no producer (``Σ_k w[k, e]``, h = 1)."""
    if f.op in ("sum", "max", "min"):
        return True
    return f.op == "splitk" and not accessed(f.term.args[1], ("run", "prev"))


def split_factors(programs: int, extent: int, block_keys: int, sms: int,
                  past_waves: bool = False) -> list[int]:
    """Split factors worth considering for a grid of ``programs``: for one, two and four
    programs an SM, the most that do not overfill ``sms`` (at most k·sms programs: whole
    waves where an SM holds one program), with chunks of at least two key blocks.

    Not the fewest that fill them: a factor just past a wave leaves a short last wave.
    Causal decode of 32 heads at 32768 keys (H200, fp16 D=128, 128-key blocks, one
    program an SM) ran 3.40 TB/s at 5 splits (160 programs) and 4.37 at 4 (128); at 64
    keys 3.92 at 9 and 4.32 at 8 (``bench/decode_configs.py --sweep``, session 48).  At
    2048 and 8192 keys, and for GQA's 8 programs (16 or 17 splits), the pairs timed within
    2% of each other (sessions 23 and 48).  Offering both doubled the configs a decode's
    cold choice times: causal decode at 8192 keys built in 13.9 s with both, 8.4 with
    these (H200, session 48).

    ``past_waves``: the fewest that fill them instead, as the cost model weighs split-k
    (``costmodel.best_estimate``): its ranking of split-k against the rolling form was
    fit so, and with whole waves it put split-k ahead for a 1000-key prefill, which the
    GPU never measured faster (``bench/results/grid_evidence.md``: rolling won all 44
    prefill rows that timed both, by 1.11-1.69x)."""
    most = max(1, extent // (2 * block_keys))
    fill = (lambda k: -(-k * sms // programs)) if past_waves else (lambda k: k * sms // programs)
    return sorted({min(most, max(1, fill(k))) for k in (1, 2, 4)})


def combine_min_rows(tp, has_dot: bool) -> int:
    """The fewest rows a program of tile plan ``tp``'s two-launch combine may take: 0
    (its rows are a row block) where it only folds the partials; else 1, or 16 where its
    code holds a ``tl.dot`` (the tensor core's least M) -- where it runs later passes or
    writes a row's columns in an epilogue loop (log-softmax's ``y = x - lse``), work a
    few programs of 64-128 rows would serialise (``runtime.launcher._combine_rows``)."""
    if len(tp.passes) == 1 and not any(item.loop_axes for item in tp.epilogue):
        return 0
    return 16 if has_dot else 1
