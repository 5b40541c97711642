"""The constructor table shared by the e-graph stage and extraction (no egglog import)."""

# egglog name -> (loop-IR op, argument kinds)
CONSTRUCTORS: dict[str, tuple[str, str]] = {
    "Var": ("var", "S"), "Int": ("int", "I"), "Flt": ("flt", "F"),
    "Load": ("load", "SX"), "Acc": ("ref", "SX"), "Run": ("run", "SX"), "Prev": ("prev", "SX"),
    "Neg": ("neg", "T"), "Exp": ("exp", "T"), "Exp2": ("exp2", "T"), "Log": ("log", "T"),
    "Tanh": ("tanh", "T"), "Sqrt": ("sqrt", "T"), "Rsqrt": ("rsqrt", "T"), "Abs": ("abs", "T"),
    "Not": ("not", "T"), "Cast": ("cast", "ST"),
    "Sin": ("sin", "T"), "Cos": ("cos", "T"), "Erf": ("erf", "T"),
    "Add": ("add", "TT"), "Sub": ("sub", "TT"), "Mul": ("mul", "TT"), "Div": ("div", "TT"),
    "Maximum": ("maximum", "TT"), "Minimum": ("minimum", "TT"),
    "FloorDiv": ("floordiv", "TT"), "Mod": ("mod", "TT"),
    "Lt": ("lt", "TT"), "Le": ("le", "TT"), "Gt": ("gt", "TT"), "Ge": ("ge", "TT"),
    "Eq": ("eq", "TT"), "Ne": ("ne", "TT"), "And": ("and", "TT"), "Or": ("or", "TT"),
    "BitAnd": ("bitand", "TT"), "BitOr": ("bitor", "TT"), "BitXor": ("bitxor", "TT"),
    "Where": ("where", "TTT"),
    "Sum": ("sum", "ST"), "Max": ("max", "ST"), "Min": ("min", "ST"),
    "RollSum": ("rollsum", "STT"), "RollMax": ("rollmax", "STT"), "SplitK": ("splitk", "STT"),
}
EGG_NAME = {op: name for name, (op, _) in CONSTRUCTORS.items()}
