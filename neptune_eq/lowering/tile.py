"""A tile of generated code: the value every codegen step passes around."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tile:
    code: str                 # a variable name or literal
    axes: tuple[str, ...]     # kernel axes, canonical order
    kind: str                 # "f32", "int", "bool", or a storage dtype of a raw load
    # a per-block row tile still to be added (``block_shift``); only ``Emitter.lazy``
    # hands out such tiles, ``Emitter.expr`` adds the shift in
    shift: "Tile | None" = None
