"""neptune_eq: an equality-saturation superoptimizer for chains of GPU reductions."""
from .runtime import prefer_interpreter_without_gpu as _prefer_interpreter

_prefer_interpreter()  # before anything imports triton: CPU-only machines interpret
from .dsl import (placeholder, reduce_axis, compute, sum, max, min, exp, exp2, log, tanh,  # noqa: A004
                  sqrt, rsqrt, abs, maximum, minimum, where, cast, build_program)
from .ir import ProgramError
from .api import Kernel, superoptimize
from .attention import attention
from .egraph.saturate import Limits
from . import rules  # noqa: E402  (ne.rules.load / check / listing)
