"""Codegen, tile expressions: IR terms -> Triton tile code inside a kernel body.

Every value is a tile whose dimensions are named by kernel axes, kept in one canonical
order (block axis, the pass's loop axis, whole axes, epilogue loop axis), so broadcasting
is `[:, None]` indexing decided by name.  A sum over an axis of a product of two 2-D tiles
that share only that axis becomes ``tl.dot`` (the QKᵀ and P·V contractions of attention)
-- or, in a kernel of at most ``VDOT_ROWS`` rows, a choice behind the constexpr ``VDOT``
between ``tl.dot`` and a broadcast product summed on the CUDA cores (see ``_try_dot``);
everything else is elementwise math and ``tl.sum``/``tl.max``.  Loop-invariant terms are
hoisted before the loops; common subterms are emitted once per scope.  The kernels'
structure (prologue, pass loops, split-k partials and combine, stores) is ``kernelgen``.
"""
from __future__ import annotations

import re

from ..ir import FLOAT_DTYPES, MASKED, Term, free_axes, reads_data
from . import block_shift, descriptors
from .data_indices import safe_index
from .tile import Tile
from .lower import LoweringError, TilePlan, max_before_scale

NEG = repr(MASKED)   # masked / initial max: a large finite negative, never -inf
POS = repr(-MASKED)
LOOP = "L"        # tile axis of the current pass's loop
ECOL = "C"        # tile axis of the epilogue's column loop
SPLIT = "P"       # tile axis of a block of split-k partials in the combine kernel
_TL_DTYPE = {"float16": "tl.float16", "bfloat16": "tl.bfloat16", "float32": "tl.float32",
             "float64": "tl.float64", "int32": "tl.int32", "int64": "tl.int64", "bool": "tl.int1"}
_UNARY = {"exp": "tl.exp({})", "exp2": "tl.exp2({})", "log": "tl.log({})",
          "sqrt": "tl.sqrt({})", "rsqrt": "tl.rsqrt({})", "abs": "tl.abs({})",
          "neg": "-({})", "tanh": "(2.0 * tl.sigmoid(2.0 * ({})) - 1.0)", "not": "({} == 0)",
          "sin": "tl.sin({})", "cos": "tl.cos({})", "erf": "tl.math.erf({})"}
_BINARY = {"add": "{} + {}", "sub": "{} - {}", "mul": "{} * {}", "div": "{} / {}",
           "maximum": "tl.maximum({}, {})", "minimum": "tl.minimum({}, {})",
           "floordiv": "{} // {}", "mod": "{} % {}", "lt": "{} < {}", "le": "{} <= {}",
           "gt": "{} > {}", "ge": "{} >= {}", "eq": "{} == {}", "ne": "{} != {}",
           "and": "{} & {}", "or": "{} | {}",
           "bitand": "{} & {}", "bitor": "{} | {}", "bitxor": "{} ^ {}"}
_BITWISE = ("bitand", "bitor", "bitxor")  # integer in, integer out (booleans count as 0/1)
VDOT_FLAG = "VDOT"  # constexpr of every kernel: contractions on the CUDA cores (``_try_dot``)
# A tensor-core tile has at least 16 rows: a decode of one query row (two when two heads
# share a KV head) would compute 15 padding rows per product and move its operands through
# shared memory; on the CUDA cores the tile is [rows, keys, width] in registers.  Wider
# packings (GQA groups of 8) keep tl.dot: their product tile would not fit in registers.
VDOT_ROWS = 2
_SIMPLE = re.compile(r"^(-?[0-9.e+-]+|[A-Za-z_][A-Za-z_0-9]*)$")
_ARITH = {"add", "sub", "mul", "div", "maximum", "minimum"}


def init_fill(op: str) -> str:
    """A fold state's starting value: the identity of its operator."""
    return NEG if op in ("max", "rollmax") else POS if op == "min" else "0.0"


def grid_decode(plan: TilePlan) -> list[str]:
    """Lines that split the flat program id ``pid_grid`` into one ``ax_<a>`` per grid axis
    (last axis fastest)."""
    lines, rest = [], "pid_grid"
    for a in reversed(plan.grid_axes):
        n = plan.grid_extent(a)
        lines += [f"ax_{a} = {rest} % {n}", f"{rest}_{a} = {rest} // {n}"]
        rest = f"{rest}_{a}"
    return lines


# Triton's ``input_precision`` for a contraction of two fp32 operands, by torch's float32
# matmul precision (``torch.set_float32_matmul_precision``): "highest" keeps exact fp32
# products (CUDA cores); "high" and "medium" let torch's own matmuls use TF32 tensor cores,
# and a kernel built under them does the same.  Products with an fp16/bf16 side are fed
# to the tensor cores in that dtype whatever the setting.
FP32_DOT = {"highest": "ieee", "high": "tf32", "medium": "tf32"}


class Emitter:
    def __init__(self, plan: TilePlan, name: str, bf16_dot_in_fp32: bool = False,
                 fp32_dot: str = "ieee"):
        self.plan, self.p, self.name = plan, plan.program, name
        self.bf16_dot_in_fp32 = bf16_dot_in_fp32
        self.fp32_dot = fp32_dot
        self.lines: list[str] = []
        self.scopes: list[tuple[list[str], dict, str]] = []  # (lines, cache, indent)
        self.tmp = 0
        self.order = [SPLIT, plan.block_axis, LOOP, *plan.whole_axes, ECOL]
        # IR index variable -> kernel axis name, scalar code, or a Tile (packed rows)
        self.env: dict[str, str | Tile] = {}
        self.states: dict[str, Tile] = {}  # fold state name -> tile
        self.running: dict[str, tuple[str, str]] = {}  # fold -> (old var, new var) in a pass
        # kernel axis -> (start of its tile, bound its mask tests): what a tensor
        # descriptor needs to load the same tile (``descriptors``)
        self.ranges: dict[str, tuple[str, str]] = {}
        self.desc = descriptors.DescriptorState()
        self.vector_dots = 0  # contractions with a CUDA-core form (``VDOT``)
        self.one_loop_form = False  # a data-mask key range with a one-loop form (ONE_LOOP)
        # axis -> the constexpr sizing its tiles, where not B_<axis> (split-k's combine
        # takes the row block's real rows only: kernelgen.COMBINE_ROWS)
        self.block_sizes: dict[str, str] = {}
        # axis -> (its tile's start, its lane numbers): offs_<axis> = start + lanes, where a
        # kernel form emits them so (``block_shift`` splits a term linear in the key index)
        self.aranges: dict[str, tuple[str, str]] = {}
        self.shift_active = block_shift.active(plan)

    # -- scopes --------------------------------------------------------------------------
    def push(self, indent: str):
        self.scopes.append(([], {}, indent))

    def pop(self) -> list[str]:
        return self.scopes.pop()[0]

    def emit(self, line: str, scope: int = -1):
        lines, _, indent = self.scopes[scope]
        lines.append(indent + line)

    def store_tile(self, name: str, idx: list, axes: tuple, value_code: str,
                   pointer_line: str) -> bool:
        """Emit the store of output ``name``'s tile another way than ``pointer_line`` where
        this kernel has one (here: a TMA store, ``descriptors.store``; the Gluon skeleton
        has its own); False, with nothing emitted, where it has none."""
        return descriptors.store(self, name, idx, axes, value_code, pointer_line)

    def new(self, prefix="t") -> str:
        self.tmp += 1
        return f"{prefix}{self.tmp}"

    # -- tiles ---------------------------------------------------------------------------
    def canon(self, axes) -> tuple[str, ...]:
        present = set(axes)
        return tuple(a for a in self.order if a in present)

    def bcast(self, t: Tile, axes: tuple[str, ...]) -> str:
        if t.axes == axes or not t.axes:
            return t.code
        return f"{t.code}[{', '.join(':' if a in t.axes else 'None' for a in axes)}]"

    def f32(self, t: Tile) -> Tile:
        if t.kind in ("f32", "int", "bool"):
            return t
        return Tile(f"{t.code}.to(tl.float32)", t.axes, "f32")

    def float_of(self, t: Tile) -> Tile:
        """``t`` as fp32, integers included: tl.exp/tl.sin/... take only floats (an index
        such as ``tan(b)`` in a mod reaches them as an int)."""
        if t.kind not in ("int", "bool"):
            return self.f32(t)
        if _SIMPLE.match(t.code) and not t.code[0].isalpha() and t.code[0] != "_":
            return Tile(repr(float(t.code)), t.axes, "f32")  # a literal: no .to() on it
        return Tile(f"({t.code}).to(tl.float32)", t.axes, "f32")

    def block(self, axis: str) -> str:
        return self.block_sizes.get(axis, f"B_{axis}")

    def shape(self, axes) -> str:
        return "[" + ", ".join(self.block(a) for a in axes) + "]"

    def mask(self, axes) -> str | None:
        ms = [f"mask_{a}" for a in axes]
        if not ms:
            return None
        parts = [self.bcast(Tile(m, (a,), "bool"), tuple(axes)) for m, a in zip(ms, axes)]
        return " & ".join(parts)

    # -- expressions ---------------------------------------------------------------------
    def expr(self, t: Term) -> Tile:
        return self.plain(self.lazy(t))

    def lazy(self, t: Term) -> Tile:
        """``t``'s tile, which may carry a per-block shift (``block_shift``): for the ops
        that pass one on (+, −, ·, where, a row max); every other reader takes ``expr``."""
        key = t
        for lines, cache, _ in reversed(self.scopes):
            if key in cache:
                return cache[key]
        scope = self._scope_for(t)
        tile = self._expr(t, scope)
        self.scopes[scope][1][key] = tile
        return tile

    def plain(self, t: Tile) -> Tile:
        """``t`` with its shift added in (once per scope)."""
        if t.shift is None:
            return t
        key = ("plain", t.code, t.shift.code)
        for _, cache, _ in reversed(self.scopes):
            if key in cache:
                return cache[key]
        axes = self.canon(t.axes + t.shift.axes)
        tile = self.bind(f"{self.bcast(t, axes)} + {self.bcast(t.shift, axes)}", axes, "f32", -1)
        self.scopes[-1][1][key] = tile
        return tile

    def _scope_for(self, t: Term) -> int:
        """Hoist to the prologue (scope 0) when the term reads no fold state and does
        not move with a loop."""
        if any(n.kind == "access" and n.op != "load" for n in t.walk()):
            return -1
        loop_vars = {v for v, ax in self.env.items() if (ax in (LOOP, ECOL) if isinstance(ax, str)
                     else isinstance(ax, Tile) and {LOOP, ECOL} & set(ax.axes))}
        loop_vars |= self.plan.chunked  # a chunk of a wide contraction exists inside its loop
        return 0 if not (free_axes(t) & loop_vars) else -1

    def bind(self, code: str, axes, kind: str, scope: int) -> Tile:
        if _SIMPLE.match(code):
            return Tile(code, axes, kind)
        v = self.new()
        self.emit(f"{v} = {code}", scope)
        return Tile(v, axes, kind)

    def _expr(self, t: Term, scope: int) -> Tile:
        op = t.op
        if op == "var":
            role = self.env.get(t.val)
            if isinstance(role, Tile):
                return role
            if role is None:
                raise LoweringError(f"Index variable {t.val!r} has no kernel axis here.")
            if role in self.order:
                return Tile(f"offs_{role}", (role,), "int")
            return Tile(role, (), "int")
        if op == "int":
            return Tile(str(int(t.val)), (), "int")
        if op == "flt":
            return Tile(repr(float(t.val)), (), "f32")
        if op == "load":
            return self._load(t, scope)
        if op in ("ref", "run", "prev"):
            return self._state(t)
        if op in _UNARY:
            a = self.expr(t.args[0])
            if op == "not":
                return self.bind(_UNARY[op].format(a.code), a.axes, "bool", scope)
            if not (op in ("neg", "abs") and a.kind == "int"):
                a = self.float_of(a)
            return self.bind(_UNARY[op].format(a.code), a.axes, a.kind, scope)
        if op == "cast":
            a = self.expr(t.args[0])
            kind = "f32" if t.val in FLOAT_DTYPES else ("bool" if t.val == "bool" else "int")
            target = "tl.float32" if kind == "f32" else _TL_DTYPE[t.val]
            return self.bind(f"{a.code}.to({target})", a.axes, kind, scope)
        if op in ("floordiv", "mod") and self.plan.packed and t.args[0] == Term("var", (), self.plan.packed[0]) \
                and t.args[1] == Term("int", (), self.plan.packed[1]):
            # packed heads: y // G is the program's KV head, y % G the row's head in the group
            y = self.plan.packed[0]
            return Tile(f"ax_{y}", (), "int") if op == "floordiv" else self.env[f"{y}%"]
        if op in ("add", "sub", "mul") and self.shift_active:
            shifted = self._shifted_binary(t, scope)
            if shifted is not None:
                return shifted
        if op in _BINARY:
            a, b = (self.expr(x) for x in t.args)
            if op in _ARITH or op in ("lt", "le", "gt", "ge", "eq", "ne"):
                if "f32" in (a.kind, b.kind) or a.kind not in ("int", "bool") or b.kind not in ("int", "bool"):
                    a, b = self.f32(a), self.f32(b)
            axes = self.canon(a.axes + b.axes)
            kind = ("bool" if op in ("lt", "le", "gt", "ge", "eq", "ne", "and", "or")
                    else ("bool" if a.kind == b.kind == "bool" else "int") if op in _BITWISE
                    else "int" if a.kind == b.kind == "int" else "f32")
            if op == "div" and kind == "int":
                kind = "f32"
                a, b = self.float_of(a), self.float_of(b)  # (a literal gets no .to())
            code = _BINARY[op].format(self.bcast(a, axes), self.bcast(b, axes))
            return self.bind(code, axes, kind, scope)
        if op == "where":
            if self.shift_active:
                x = self.lazy(t.args[1])
                if x.shift is not None:
                    p, d = self.expr(t.args[0]), self.f32(self.expr(t.args[2]))
                    shifted = block_shift.where(self, p, x, d, LOOP, scope)
                    if shifted is not None:
                        return shifted
            c, a, b = (self.expr(x) for x in t.args)
            a, b = self.f32(a), self.f32(b)
            axes = self.canon(c.axes + a.axes + b.axes)
            code = f"tl.where({self.bcast(c, axes)}, {self.bcast(a, axes)}, {self.bcast(b, axes)})"
            return self.bind(code, axes, "f32", scope)
        if t.kind == "reduce":
            return self._inner_reduce(t, scope)
        raise LoweringError(f"Codegen cannot emit {op!r} here (a fold nested in a fold?).")

    def _shifted_binary(self, t: Term, scope: int) -> Tile | None:
        """+, −, · where a term linear in the key index splits off a per-block shift, or
        an operand carries one (``block_shift``); None: the plain form."""
        if t.op == "mul":
            src = block_shift.source(self, t, LOOP)
            if src is not None:
                return src
        a, b = (self.lazy(x) for x in t.args)
        if a.shift is None and b.shift is None:
            return None
        a, b = (x if x.shift is not None else self.f32(x) for x in (a, b))
        if any(x.kind != "f32" for x in (a, b)):
            return None
        return block_shift.combine(self, t.op, a, b, LOOP, scope)

    def _load(self, t: Term, scope: int) -> Tile:
        same = self._same_load(t)
        if same is not None:
            return same
        shape = self.p.shape_of(t.val)
        idx = [self._index(a, n, scope) for a, n in zip(t.args, shape)]
        axes = self.canon(sum((i.axes for i in idx), ()))
        strides = [f"{t.val}_s{k}" for k in range(len(idx))]
        off = " + ".join(f"{self.bcast(i, axes)} * {s}" for i, s in zip(idx, strides)) or "0"
        m = self.mask(axes)
        mask = f", mask={m}, other=0.0" if m else ""
        dtype = self.p.dtype_of(t.val)
        # Integer and boolean loads are values of kind int / bool, like index variables:
        # an id read from a captured tensor can index another load (offsets[doc[i]]).
        kind = "int" if dtype in ("int32", "int64") else "bool" if dtype == "bool" else dtype
        code = f"tl.load({t.val}_ptr + {off}{mask})"
        var = descriptors.load(self, t.val, idx, axes, code, scope)  # or a TMA tile
        tile = Tile(var, axes, kind) if var else self.bind(code, axes, kind, scope)
        self.scopes[scope][1][("load", self._load_signature(t))] = (t, tile)
        return tile

    def _index(self, a: Term, n, scope: int) -> Tile:
        """The tile of index ``a`` into a dim of ``n`` entries.  An index read from data
        (offsets[doc[i]]) follows torch's rule, never outside the tensor
        (``data_indices``); an affine one was checked when the program was traced -- on
        every visible pair, not on the padding lanes the mask covers, so one moving with
        the loop (``rel[i - j + n]``) is clamped too: no lane's address leaves the tensor
        even where a form's mask would not reach the load (a negative offset faults at an
        allocation's start)."""
        i = self.expr(a)
        if reads_data(a):
            return self.bind(safe_index(i.code, n), i.axes, "int", scope)
        if a.op not in ("var", "int") and LOOP in i.axes:
            return self.bind(f"tl.minimum(tl.maximum({i.code}, 0), {n} - 1)", i.axes, "int",
                             scope)
        return i

    def _load_signature(self, t: Term) -> tuple:
        """A load's identity up to the names of whole axes of equal extent: the backward's
        ``dO[i, e]``, ``dO[i, e']`` and ``dO[i, e'']`` (one per sum the adjoint wrote) are
        one tile of memory, and Triton does not merge loads.  Whole axes of one extent have
        identical offsets and masks, so one load serves every name -- of one *extent*, not
        one padded block: ``t[i]`` and ``t[j]`` over 9 and 13 entries both pad to 16, but
        their masks differ (a backward reading a table at queries and keys was wrong)."""
        def canon(a: Term) -> Term:
            if a.op == "var" and a.val in self.plan.whole_axes and self.env.get(a.val) == a.val:
                extent = self.p.extents[a.val]
                return Term("var", (), f"#whole{self.plan.whole_axes[a.val]}:{extent}")
            return a.map_args(canon)
        return (t.val, tuple(canon(a) for a in t.args))

    def _same_load(self, t: Term) -> Tile | None:
        """An earlier load of the same memory (``_load_signature``) in a visible scope, with
        its whole axes renamed to this load's; None when there is none or the renaming
        would reorder the tile's axes."""
        sig = ("load", self._load_signature(t))
        for _, cache, _ in reversed(self.scopes):
            if sig in cache:
                old, tile = cache[sig]
                break
        else:
            return None
        ren: dict[str, str] = {}
        for a, b in zip(old.args, t.args):
            for x, y in zip(a.walk(), b.walk()):
                if x.op == "var" and y.op == "var" and x.val != y.val:
                    if ren.setdefault(x.val, y.val) != y.val:
                        return None
        axes = tuple(ren.get(a, a) for a in tile.axes)
        if self.canon(axes) != axes or len(set(axes)) != len(axes):
            return None
        return Tile(tile.code, axes, tile.kind)

    def _state(self, t: Term) -> Tile:
        if not t.args and t.op == "ref" and t.val in self.states:
            return self.states[t.val]  # a nested fold's state, after its pass
        d = self.p.definition(t.val)
        want = tuple(Term("var", (), a) for a in d.axes)
        if t.args != want:
            raise LoweringError(f"A read of {t.val} at [{', '.join(map(str, t.args))}] must use "
                                f"its own axes [{', '.join(d.axes)}]; name the axes alike.")
        st = self.states[t.val]
        if t.op == "ref":
            return st
        old, new = self.running[t.val]
        var = new if t.op == "run" else old
        return Tile(var, self.states.get(var, st).axes, "f32")  # split-k partials carry axis P

    def reduce_tile(self, op: str, body_term: Term, axis_var: str, kaxis: str, scope: int,
                    extent: int, fill: str | None = None) -> Tile:
        """``op`` over kernel axis ``kaxis`` of ``body_term``, masking padding (with
        ``fill``, else the operator's identity)."""
        op = "rollsum" if op == "splitk" else op  # a split fold's block update is a rolling one
        if op in ("sum", "rollsum") and body_term.op == "mul":
            dot = self._try_dot(body_term, kaxis, scope)
            if dot is not None:
                return dot
        scale = max_before_scale(op, body_term)
        if scale is not None:
            # max_j(x·c) = c·max_j(x) for c > 0, exactly (rounding is monotone): one
            # multiply per row instead of one per element -- a score's row max no longer
            # pays for its own scaled copy of the block.  The padding fill is divided by c
            # so the scaled result keeps the identity's magnitude.
            inner, c = scale
            fill = repr(float(init_fill(op)) / c)
            part = self.reduce_tile(op, inner, axis_var, kaxis, scope, extent, fill)
            return self.bind(f"{part.code} * {c!r}", part.axes, "f32", scope)
        lazy = self.lazy(body_term) if op in ("max", "rollmax", "min") else None
        if lazy is not None and lazy.shift is not None and kaxis in lazy.axes \
                and kaxis not in lazy.shift.axes:
            # max_j(x + t) = max_j(x) + t: the block's shift joins each row once
            part = self.reduce_tile_of(op, Tile(lazy.code, lazy.axes, "f32"), kaxis, scope, fill)
            axes = self.canon(part.axes + lazy.shift.axes)
            return self.bind(f"{self.bcast(part, axes)} + {self.bcast(lazy.shift, axes)}", axes,
                             "f32", scope)
        body = self.f32(self.expr(body_term))
        if kaxis not in body.axes:
            if op in ("sum", "rollsum"):
                return self.bind(f"{body.code} * {extent}.0", body.axes, "f32", scope)
            return body
        return self.reduce_tile_of(op, body, kaxis, scope, fill)

    def reduce_tile_of(self, op: str, body: Tile, kaxis: str, scope: int,
                       fill: str | None = None) -> Tile:
        """``op`` over kernel axis ``kaxis`` of the tile ``body``, padding masked."""
        ident = fill or {"sum": "0.0", "rollsum": "0.0", "max": NEG, "rollmax": NEG, "min": POS}[op]
        pos = body.axes.index(kaxis)
        masked = f"tl.where({self.bcast(Tile(f'mask_{kaxis}', (kaxis,), 'bool'), body.axes)}, {body.code}, {ident})"
        fn = {"sum": "tl.sum", "rollsum": "tl.sum", "max": "tl.max", "rollmax": "tl.max",
              "min": "tl.min"}[op]
        rest = tuple(a for a in body.axes if a != kaxis)
        return self.bind(f"{fn}({masked}, axis={pos})", rest, "f32", scope)

    def _try_dot(self, t: Term, kaxis: str, scope: int) -> Tile | None:
        a, b = (self.expr(x) for x in t.args)
        if len(a.axes) != 2 or len(b.axes) != 2 or kaxis not in a.axes or kaxis not in b.axes:
            return None
        m = next(x for x in a.axes if x != kaxis)
        n = next(x for x in b.axes if x != kaxis)
        if m == n:
            return None
        if self.canon((m, n)) != (m, n):
            # Cᵀ = Bᵀ·Aᵀ: swap the operands so the product comes out in the tile order,
            # rather than transposing an accumulator (a trip through shared memory).
            a, b, m, n = b, a, n, m
            t = Term(t.op, (t.args[1], t.args[0]), t.val)
        lhs = a if a.axes == (m, kaxis) else Tile(f"tl.trans({a.code})", (m, kaxis), a.kind)
        rhs = b if b.axes == (kaxis, n) else Tile(f"tl.trans({b.code})", (kaxis, n), b.kind)
        lhs, rhs = (self._zero_k_padding(x, o, kaxis) for x, o in zip(t.args, (lhs, rhs)))
        vector = self._vector_dot(t, a, b, kaxis) if self.plan.row_extent <= VDOT_ROWS else None
        low = [k for k in (lhs.kind, rhs.kind) if k in ("float16", "bfloat16")]
        if low and low[0] == "bfloat16" and self.bf16_dot_in_fp32:
            low = []  # see generate(): the interpreter's bf16 dot is wrong
        if low:
            dt = _TL_DTYPE[low[0]]
            lc = lhs.code if lhs.kind == low[0] else f"({lhs.code}).to({dt})"
            rc = rhs.code if rhs.kind == low[0] else f"({rhs.code}).to({dt})"
            code = f"tl.dot({lc}, {rc})"
        else:
            code = (f"tl.dot({self.f32(lhs).code}, {self.f32(rhs).code}, "
                    f"input_precision=\"{self.fp32_dot}\")")
        out_axes = self.canon((m, n))
        if out_axes != (m, n):
            code = f"tl.trans({code})"
        if vector is not None:  # Triton compiles only the branch the config selects
            code = f"({vector} if {VDOT_FLAG} else {code})"
        return self.bind(code, out_axes, "f32", scope)

    def _zero_k_padding(self, term: Term, tile: Tile, kaxis: str) -> Tile:
        """Operand ``tile`` of a contraction over ``kaxis``, its padding along that axis
        exactly zero: a masked load is zero there already; a computed operand (which may
        be inf there) is masked."""
        if term.op == "load":
            return tile
        km = self.bcast(Tile(f"mask_{kaxis}", (kaxis,), "bool"), tile.axes)
        return Tile(f"tl.where({km}, {tile.code}, 0.0)", tile.axes, tile.kind)

    def _vector_dot(self, t: Term, a: Tile, b: Tile, kaxis: str) -> str:
        """The contraction Σ_k a·b on the CUDA cores: both operands broadcast by axis name
        to [m, n, k] in the canonical order and summed over k, in fp32 (P stays fp32, where
        tl.dot rounds it to the input dtype).  As for tl.dot, padding along k must add 0: a
        masked load is 0 there, a computed operand is masked."""
        self.vector_dots += 1
        ops = [self._zero_k_padding(x, self.f32(o), kaxis) for x, o in zip(t.args, (a, b))]
        axes = self.canon(ops[0].axes + ops[1].axes)
        prod = " * ".join(self.bcast(o, axes) for o in ops)
        return f"tl.sum({prod}, axis={axes.index(kaxis)})"

    def _inner_reduce(self, t: Term, scope: int) -> Tile:
        ax = t.val
        self.env[ax] = ax  # inner contraction axes are held whole ...
        n = self.p.extents[ax]
        if ax not in self.plan.chunked:
            return self.reduce_tile(t.op, t.args[0], ax, ax, scope, n)
        # ... or, too wide for registers, folded chunk by chunk in a loop of their own
        # (the K loop of x·W inside the V loop of a log-sum-exp): nothing that moves
        # with the chunk leaves the loop, so the logits tile is never materialised.
        outer = self.scopes[scope][2]
        self.push(outer + "    ")
        c = self.new("c")
        self.emit(f"offs_{ax} = {c} + tl.arange(0, B_{ax})")
        self.emit(f"mask_{ax} = offs_{ax} < {n}")
        part = self.reduce_tile(t.op, t.args[0], ax, ax, -1, n)
        acc = self.new("acc")
        upd = {"sum": "{a} + {p}", "max": "tl.maximum({a}, {p})", "min": "tl.minimum({a}, {p})"}
        self.emit(f"{acc} = " + upd[t.op].format(a=acc, p=self.bcast(part, part.axes)))
        body = self.pop()
        init = {"sum": "0.0", "max": NEG, "min": POS}[t.op]
        shape = self.shape(part.axes) if part.axes else "[]"
        self.emit(f"{acc} = tl.full({shape}, {init}, tl.float32)", scope)
        self.emit(f"for {c} in range(0, {n}, B_{ax}):", scope)
        self.scopes[scope][0].extend(body)
        return Tile(acc, part.axes, "f32")

