"""Reduction chains beyond attention, written plainly as a new user would (issue 15).

Each chain is a DSL program plus an fp64 torch reference.  They are chosen to cover
*patterns* the lowering must handle, not operators:

* an elementwise definition between reductions (a normaliser with an extra term, a
  statistic derived from a reduction, an output combining several fused results);
* one reduction read by several later reductions, and chains with two outputs;
* gather indexing by a tensor value (a target id per row, ``x[i, t[i]]``);
* a contraction over one axis feeding a reduction over another (logits ``x·W`` then a
  log-sum-exp over the vocabulary): a nested loop with a tile dot inside.

``CHAINS`` maps a name to a ``Chain``; ``chain.build(sizes)`` returns the output tensors
and ``chain.reference(inputs)`` the outputs computed by torch in fp64.  Sizes are
``N`` rows, ``M`` columns, ``E`` output features, ``K`` contraction, ``V`` vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import dsl as ne

EPS = 1e-5


@dataclass(frozen=True)
class Chain:
    name: str
    pattern: str                                  # what the chain exercises
    build: Callable[[dict], list]                 # sizes -> output tensors (outputs in order)
    reference: Callable[[dict], dict]             # fp64 torch inputs -> {output: tensor}
    passes: int = 1                               # passes over memory of the fused form
    index_bounds: Callable[[dict], dict] = lambda s: {}  # int input -> exclusive upper bound

    def program(self, sizes: dict):
        return ne.build_program(self.build(sizes))


def _rows(s):  # x[N, M], the common input
    x = ne.placeholder((s["N"], s["M"]), "float32", "x")
    return x, ne.reduce_axis(s["M"], "j"), ne.reduce_axis(s["M"], "k")


def _row_max(x, s, j):
    return ne.compute((s["N"],), lambda i: ne.max(x[i, j], axis=j), "mx")


# -- cause 1: elementwise definitions between reductions ------------------------------
def _softmax_plus_c(s):
    x, j, k = _rows(s)
    c = ne.placeholder((s["N"],), "float32", "c")
    mx = _row_max(x, s, j)
    den = ne.compute((s["N"],), lambda i: ne.sum(ne.exp(x[i, k] - mx[i]), axis=k) + c[i] * c[i], "den")
    return [ne.compute((s["N"], s["M"]), lambda i, m: ne.exp(x[i, m] - mx[i]) / den[i], "y")]


def _softmax_plus_c_ref(t):
    x, c = t["x"], t["c"]
    e = (x - x.amax(1, keepdim=True)).exp()
    return {"y": e / (e.sum(1, keepdim=True) + (c * c)[:, None])}


def _softmax_one(s):  # "softmax1": an extra 1 in the normaliser (attention sinks)
    x, j, k = _rows(s)
    mx = _row_max(x, s, j)
    den = ne.compute((s["N"],), lambda i: ne.sum(ne.exp(x[i, k] - mx[i]), axis=k) + 1.0, "den")
    return [ne.compute((s["N"], s["M"]), lambda i, m: ne.exp(x[i, m] - mx[i]) / den[i], "y")]


def _softmax_one_ref(t):
    x = t["x"]
    e = (x - x.amax(1, keepdim=True)).exp()
    return {"y": e / (e.sum(1, keepdim=True) + 1.0)}


def _variance(s):
    x, j, k = _rows(s)
    mean = ne.compute((s["N"],), lambda i: ne.sum(x[i, j], axis=j) / s["M"], "mean")
    return [ne.compute((s["N"],), lambda i: ne.sum((x[i, k] - mean[i]) * (x[i, k] - mean[i]),
                                                   axis=k) / s["M"], "var")]


def _layernorm(s):  # mean -> variance -> std -> normalised row: three statistics chained
    x, j, k = _rows(s)
    mean = ne.compute((s["N"],), lambda i: ne.sum(x[i, j], axis=j) / s["M"], "mean")
    var = ne.compute((s["N"],), lambda i: ne.sum((x[i, k] - mean[i]) * (x[i, k] - mean[i]),
                                                 axis=k) / s["M"], "var")
    std = ne.compute((s["N"],), lambda i: ne.sqrt(var[i] + EPS), "std")
    return [ne.compute((s["N"], s["M"]), lambda i, m: (x[i, m] - mean[i]) / std[i], "y")]


def _layernorm_ref(t):
    x = t["x"]
    mu = x.mean(1, keepdim=True)
    return {"y": (x - mu) / ((x - mu).pow(2).mean(1, keepdim=True) + EPS).sqrt()}


def _entropy(s):  # H = -Σ p log p with log p written as its own definition
    x, j, k = _rows(s)
    mx = _row_max(x, s, j)
    den = ne.compute((s["N"],), lambda i: ne.sum(ne.exp(x[i, k] - mx[i]), axis=k), "den")
    logp = ne.compute((s["N"], s["M"]), lambda i, m: x[i, m] - mx[i] - ne.log(den[i]), "logp")
    h = ne.reduce_axis(s["M"], "h")
    return [ne.compute((s["N"],), lambda i: -ne.sum(ne.exp(logp[i, h]) * logp[i, h], axis=h), "ent")]


def _entropy_ref(t):
    lp = t["x"].log_softmax(1)
    return {"ent": -(lp.exp() * lp).sum(1)}


def _maxabs_matmul(s):  # y = (x / scale) · w with scale = max|x| / 127 (quantisation-style)
    x, j, k = _rows(s)
    w = ne.placeholder((s["M"], s["E"]), "float32", "w")
    amax = ne.compute((s["N"],), lambda i: ne.max(ne.abs(x[i, j]), axis=j), "amax")
    scale = ne.compute((s["N"],), lambda i: amax[i] / 127.0 + EPS, "scale")
    return [ne.compute((s["N"], s["E"]), lambda i, e: ne.sum(x[i, k] / scale[i] * w[k, e], axis=k), "y")]


def _maxabs_matmul_ref(t):
    x = t["x"]
    return {"y": (x / (x.abs().amax(1, keepdim=True) / 127.0 + EPS)) @ t["w"]}


def _sinkhorn_row(s):  # one log-domain Sinkhorn row update, then the transport plan
    x, j, k = _rows(s)  # x = -C / eps
    g = ne.placeholder((s["M"],), "float32", "g")
    loga = ne.placeholder((s["N"],), "float32", "loga")
    mx = ne.compute((s["N"],), lambda i: ne.max(x[i, j] + g[j], axis=j), "mx")
    lse = ne.compute((s["N"],), lambda i: mx[i] + ne.log(ne.sum(ne.exp(x[i, k] + g[k] - mx[i]), axis=k)), "lse")
    f = ne.compute((s["N"],), lambda i: loga[i] - lse[i], "f")
    return [ne.compute((s["N"], s["M"]), lambda i, m: ne.exp(x[i, m] + f[i] + g[m]), "plan")]


def _sinkhorn_row_ref(t):
    z = t["x"] + t["g"][None, :]
    f = t["loga"] - z.logsumexp(1)
    return {"plan": (z + f[:, None]).exp()}


def _moments(s):  # one max read by three reductions; the output combines fused results
    x, j, k = _rows(s)
    mx = _row_max(x, s, j)
    den = ne.compute((s["N"],), lambda i: ne.sum(ne.exp(x[i, k] - mx[i]), axis=k), "den")
    a, b = ne.reduce_axis(s["M"], "a"), ne.reduce_axis(s["M"], "b")
    m1 = ne.compute((s["N"],), lambda i: ne.sum(ne.exp(x[i, a] - mx[i]) * x[i, a], axis=a), "m1")
    m2 = ne.compute((s["N"],), lambda i: ne.sum(ne.exp(x[i, b] - mx[i]) * x[i, b] * x[i, b], axis=b), "m2")
    return [ne.compute((s["N"],), lambda i: m2[i] / den[i] - 0.5 * (m1[i] / den[i]) * (m1[i] / den[i]), "y")]


def _moments_ref(t):
    p = t["x"].softmax(1)
    m1, m2 = (p * t["x"]).sum(1), (p * t["x"] ** 2).sum(1)
    return {"y": m2 - 0.5 * m1 * m1}


def _softmax_and_lse(s):  # two outputs, the second read by the first
    x, j, k = _rows(s)
    mx = _row_max(x, s, j)
    lse = ne.compute((s["N"],), lambda i: mx[i] + ne.log(ne.sum(ne.exp(x[i, k] - mx[i]), axis=k)), "lse")
    y = ne.compute((s["N"], s["M"]), lambda i, m: ne.exp(x[i, m] - lse[i]), "y")
    return [y, lse]


def _softmax_and_lse_ref(t):
    return {"y": t["x"].softmax(1), "lse": t["x"].logsumexp(1)}


def _log_softmax(s):
    x, j, k = _rows(s)
    mx = _row_max(x, s, j)
    lse = ne.compute((s["N"],), lambda i: mx[i] + ne.log(ne.sum(ne.exp(x[i, k] - mx[i]), axis=k)), "lse")
    return [ne.compute((s["N"], s["M"]), lambda i, m: x[i, m] - lse[i], "y")]


def _centered_matmul(s):  # a mean (statistic of a reduction) feeding a contraction
    x, j, k = _rows(s)
    w = ne.placeholder((s["M"], s["E"]), "float32", "w")
    mean = ne.compute((s["N"],), lambda i: ne.sum(x[i, j], axis=j) / s["M"], "mean")
    return [ne.compute((s["N"], s["E"]), lambda i, e: ne.sum((x[i, k] - mean[i]) * w[k, e], axis=k), "y")]


def _centered_matmul_ref(t):
    x = t["x"]
    return {"y": (x - x.mean(1, keepdim=True)) @ t["w"]}


# -- gather indexing --------------------------------------------------------------------
def _cross_entropy(s):  # loss_i = lse_i - x[i, t[i]]
    x, j, k = _rows(s)
    tgt = ne.placeholder((s["N"],), "int64", "t")
    mx = _row_max(x, s, j)
    den = ne.compute((s["N"],), lambda i: ne.sum(ne.exp(x[i, k] - mx[i]), axis=k), "den")
    return [ne.compute((s["N"],), lambda i: mx[i] + ne.log(den[i]) - x[i, tgt[i]], "loss")]


def _cross_entropy_ref(t):
    return {"loss": t["x"].logsumexp(1) - t["x"].gather(1, t["t"][:, None])[:, 0]}


def _gathered_values(s):  # softmax weights over rows of a table picked by ids[j]
    x, j, k = _rows(s)
    ids = ne.placeholder((s["M"],), "int32", "ids")
    table = ne.placeholder((s["R"], s["E"]), "float32", "table")
    mx = _row_max(x, s, j)
    den = ne.compute((s["N"],), lambda i: ne.sum(ne.exp(x[i, k] - mx[i]), axis=k), "den")
    o = ne.reduce_axis(s["M"], "o")
    return [ne.compute((s["N"], s["E"]), lambda i, e: ne.sum(
        ne.exp(x[i, o] - mx[i]) * table[ids[o], e], axis=o) / den[i], "y")]


def _gathered_values_ref(t):
    return {"y": t["x"].softmax(1) @ t["table"][t["ids"].long()]}


def _ragged_pool(s):  # softmax pooling over the first n[i] columns of each row (n[i] = 0: none)
    x, j, k = _rows(s)
    n = ne.placeholder((s["N"],), "int32", "n")
    v = ne.placeholder((s["M"], s["E"]), "float32", "v")
    sc = ne.compute((s["N"], s["M"]), lambda i, m: ne.where(m < n[i], x[i, m], -1.0e30), "sc")
    mx = ne.compute((s["N"],), lambda i: ne.max(sc[i, j], axis=j), "mx")
    den = ne.compute((s["N"],), lambda i: ne.sum(ne.exp(sc[i, k] - mx[i]), axis=k), "den")
    o = ne.reduce_axis(s["M"], "o")
    return [ne.compute((s["N"], s["E"]), lambda i, e: ne.sum(
        ne.exp(sc[i, o] - mx[i]) * v[o, e], axis=o) / den[i], "y")]


def _ragged_pool_ref(t):
    import torch
    cols = torch.arange(t["x"].shape[1], device=t["x"].device)[None, :]
    sc = torch.where(cols < t["n"][:, None], t["x"], torch.full_like(t["x"], -1.0e30))
    return {"y": sc.softmax(1) @ t["v"]}  # a fully masked row: uniform weights, as written


# -- cause 2: a contraction over K feeding a reduction over V ------------------------------
def _logits(s):
    x = ne.placeholder((s["N"], s["K"]), "float32", "x")
    w = ne.placeholder((s["K"], s["V"]), "float32", "w")
    kk = ne.reduce_axis(s["K"], "kk")
    z = ne.compute((s["N"], s["V"]), lambda i, v: ne.sum(x[i, kk] * w[kk, v], axis=kk), "z")
    return x, w, z


def _linear_lse(s):
    _, _, z = _logits(s)
    j, k = ne.reduce_axis(s["V"], "j"), ne.reduce_axis(s["V"], "k")
    mx = ne.compute((s["N"],), lambda i: ne.max(z[i, j], axis=j), "mx")
    return [ne.compute((s["N"],), lambda i: mx[i] + ne.log(ne.sum(ne.exp(z[i, k] - mx[i]), axis=k)), "lse")]


def _linear_lse_ref(t):
    return {"lse": (t["x"] @ t["w"]).logsumexp(1)}


def _linear_cross_entropy(s):  # the target logit gathered from the weight: w[k, t[i]]
    x, w, z = _logits(s)
    tgt = ne.placeholder((s["N"],), "int64", "t")
    j, k = ne.reduce_axis(s["V"], "j"), ne.reduce_axis(s["V"], "k")
    mx = ne.compute((s["N"],), lambda i: ne.max(z[i, j], axis=j), "mx")
    den = ne.compute((s["N"],), lambda i: ne.sum(ne.exp(z[i, k] - mx[i]), axis=k), "den")
    kt = ne.reduce_axis(s["K"], "kt")
    zt = ne.compute((s["N"],), lambda i: ne.sum(x[i, kt] * w[kt, tgt[i]], axis=kt), "zt")
    return [ne.compute((s["N"],), lambda i: mx[i] + ne.log(den[i]) - zt[i], "loss")]


def _linear_cross_entropy_ref(t):
    z = t["x"] @ t["w"]
    return {"loss": z.logsumexp(1) - z.gather(1, t["t"][:, None])[:, 0]}


def _variance_ref(t):
    return {"var": t["x"].var(1, unbiased=False)}


def _log_softmax_ref(t):
    return {"y": t["x"].log_softmax(1)}


CHAINS: dict[str, Chain] = {c.name: c for c in [
    Chain("softmax-plus-c", "normaliser with an extra per-row term (elementwise def of a reduction)",
          _softmax_plus_c, _softmax_plus_c_ref, passes=2),
    Chain("softmax-one", "normaliser + 1 (elementwise def of a reduction)", _softmax_one,
          _softmax_one_ref, passes=2),
    Chain("variance", "mean = Σx/M feeding a second reduction", _variance, _variance_ref, passes=2),
    Chain("layernorm", "mean -> variance -> std -> normalised row (three chained statistics)",
          _layernorm, _layernorm_ref, passes=3),
    Chain("entropy", "softmax entropy -Σ p·log p (log p an elementwise def of two reductions)",
          _entropy, _entropy_ref, passes=2),
    Chain("maxabs-matmul", "max-abs scaled matmul (scale an elementwise def of a max)",
          _maxabs_matmul, _maxabs_matmul_ref, passes=1),
    Chain("sinkhorn-row", "log-domain Sinkhorn row step (f = log a - LSE) and the plan",
          _sinkhorn_row, _sinkhorn_row_ref, passes=2),
    Chain("moments", "one max read by three reductions; output a/b - λ·(c/b)²", _moments,
          _moments_ref, passes=1),
    Chain("softmax-and-lse", "two outputs, one read by the other", _softmax_and_lse,
          _softmax_and_lse_ref, passes=2),
    Chain("log-softmax", "elementwise output of an elementwise-of-reductions def", _log_softmax,
          _log_softmax_ref, passes=2),
    Chain("centered-matmul", "a mean (elementwise def) feeding a contraction", _centered_matmul,
          _centered_matmul_ref, passes=1),
    Chain("cross-entropy", "gather x[i, t[i]] by a target id per row", _cross_entropy,
          _cross_entropy_ref, passes=1, index_bounds=lambda s: {"t": s["M"]}),
    Chain("gathered-values", "softmax-weighted rows of a table gathered by ids[j] inside the loop",
          _gathered_values, _gathered_values_ref, passes=1,
          index_bounds=lambda s: {"ids": s["R"]}),
    Chain("ragged-pool", "a per-row length n[i] read inside the loop masks it (n[i] = 0: fully "
          "masked row)", _ragged_pool, _ragged_pool_ref, passes=1,
          index_bounds=lambda s: {"n": s["M"] + 1}),
    Chain("linear-lse", "contraction over K feeding a log-sum-exp over V (nested loop)",
          _linear_lse, _linear_lse_ref, passes=1),
    Chain("linear-cross-entropy", "logits x·W, LSE over V, target logit via w[k, t[i]] (gather)",
          _linear_cross_entropy, _linear_cross_entropy_ref, passes=2,
          index_bounds=lambda s: {"t": s["V"]}),
]}


def random_inputs(chain: Chain, program, sizes: dict, seed: int = 0, scale: float = 1.0) -> dict:
    """fp64 inputs for ``program``: the scores ``x`` ~ N(0, scale²), other floats ~ N(0, 1)
    (a large log-marginal or weight would overflow the true result, not the kernel),
    index tensors in range; a length ``n`` is 0 in the first row (a fully masked row)."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    bounds = chain.index_bounds(sizes)
    missing = [ph.name for ph in program.inputs if ph.dtype in ("int32", "int64") and ph.name not in bounds]
    if missing:
        raise ValueError(f"Chain {chain.name!r} gives no index range for its integer inputs {missing}; "
                         "expected index_bounds to map each to its exclusive upper bound.")
    out = {}
    for ph in program.inputs:
        if ph.dtype in ("int32", "int64"):
            out[ph.name] = torch.randint(0, bounds[ph.name], ph.shape, generator=gen,
                                         dtype=getattr(torch, ph.dtype))
            if ph.name == "n":
                out[ph.name][0] = 0
        else:
            out[ph.name] = torch.randn(ph.shape, generator=gen, dtype=torch.float64) * (
                scale if ph.name == "x" else 1.0)
    return out
