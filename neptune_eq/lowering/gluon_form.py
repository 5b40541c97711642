"""What a generated Gluon module is, apart from its code (``gluon_ws``, ``gluon_sums``):
the inputs its descriptors stream, the tiles and ring it holds in shared memory, how its
programs walk their tiles, and the launch options that let an SM hold as many of them as
intended.  The launcher (``runtime.gluon_launch``) and the config list
(``runtime.tile_configs``) read it; the emitters fill it in.
"""
from __future__ import annotations

from dataclasses import dataclass

from .gluon_tiles import ROWS, own_block_limit

WIDTHS = (64, 128)  # contraction and column widths the skeleton issues
KEY_BLOCKS = (64, 128)  # key blocks (B_L) it issues: the wgmma N of the score tile
SMEM_BYTES = 224 * 1024  # row tiles + ring: Hopper's 227 KiB per program, less barriers
SM_SMEM, SM_REGS = 228 * 1024, 65536  # an SM's shared memory and register file (sm_90)


@dataclass
class GluonForm:
    """The Gluon module of a plan and what its launcher needs."""
    name: str
    source: str
    streamed: tuple[str, str, str]   # inputs (a, b, c): row tile, first and second contraction's
    widths: tuple[int, int]          # (contraction width of a/b, column width of c)
    dtype: str                       # the 16-bit dtype of a, b and c
    params: list[str]                # pointer parameters after the three descriptors
    persistent: bool = False         # one program per SM walking the tiles (else per tile)
    key_blocks: tuple[int, ...] = KEY_BLOCKS  # the key blocks worth timing (see generate)
    scheduled: bool = False          # persistent, in the order of the ``tile_order`` argument
    key_offsets: tuple = (None, None)  # the pass's affine key range [i + lo, i + hi)
    ranges: tuple[str, str] | None = None  # dynamic walk: (kernel, tl module) of the ranges
    consumers: int = 2               # consumer warpgroups per program, ROWS rows each
    solo: "GluonForm | None" = None  # the one-consumer form of the same plan (see generate)
    heads_first_ok: bool = False     # one program per tile, on either grid order (see
    #                                  ``grid_order``): ``TileConfig.heads_first`` runs
    dynamic: "GluonForm | None" = None  # a data mask's dynamic walk (``TileConfig.dynamic``)
    o_store: object = None           # the output tile stored by TMA (gluon_epilogue.TileStore)
    wide: "GluonForm | None" = None  # the three-consumer form at head dim 64 (see generate)
    own_blocks: bool = False         # each consumer computes only its rows' key blocks
    own_past_rows: bool = False      # ... one block where its rows lie past the extent

    def skips_blocks(self, key_block: int) -> bool:
        """Whether its consumers compute only their own rows' blocks at ``key_block``
        (``gluon_tiles.consumer_blocks``: the code tests the constexpr key block)."""
        return self.own_blocks and key_block <= own_block_limit(self.consumers)

    @property
    def rows(self) -> int:
        """Rows per program (a tile): ROWS per consumer warpgroup."""
        return ROWS * self.consumers

    def programs_per_sm(self, key_block: int, stages: int = 2) -> int:
        """Programs an SM holds at once: 1 for two consumers; for one, as many as shared
        memory and registers allow, at most 3, each consumer keeping the registers its
        tiles need (``options``)."""
        if self.consumers >= 2:
            return 1
        fit = min(3, SM_SMEM // (self.ring_bytes(key_block, stages) + 1024))
        # a consumer thread holds its share of the score tile (B_L/2 fp32), of the state
        # (cols/2 fp32) and of P (B_L/4), plus ~56 for addresses and row vectors
        # (ptxas, sm_90: head dim 64 at 64-key blocks compiles at 136, at 128 keys not)
        need = key_block * 3 // 4 + self.widths[1] // 2 + 56
        while fit > 1 and self._consumer_regs(fit) < need:
            fit -= 1
        return max(fit, 1)

    @staticmethod
    def _consumer_regs(programs: int) -> int:
        """The consumer warpgroup's registers a thread with ``programs`` programs per SM:
        each launches with 256 threads at ``maxnreg`` and the producer's warpgroup gives
        back all but 24 (``setmaxnreg``)."""
        return min(2 * GluonForm._maxnreg(programs) - 24, 256) // 8 * 8

    @staticmethod
    def _maxnreg(programs: int) -> int:
        """Registers a thread at launch for ``programs`` 256-thread programs per SM (a
        multiple of 8, as ``setmaxnreg`` counts them)."""
        return SM_REGS // (programs * 256) // 8 * 8

    def options(self, key_block: int, stages: int = 2) -> dict:
        """Triton's launch options of the form at a key block.  A one-consumer program runs
        8 warps (the producer warp is padded to a warpgroup); at Triton's default it
        launches with 256 registers a thread, which is the SM's whole file, so one program
        per SM.  ``maxnreg`` at the file's share of ``programs_per_sm`` lets them fit."""
        if self.consumers >= 2:
            return {"num_warps": 4}
        return {"num_warps": 4, "maxnreg": self._maxnreg(self.programs_per_sm(key_block, stages))}

    def form_for(self, rows: int, dynamic: bool = False) -> "GluonForm | None":
        """This form, its one-consumer or its three-consumer form, whichever runs
        ``rows``-row programs; with ``dynamic``, its dynamic walk (two consumers only)."""
        if dynamic:
            return self.dynamic if self.dynamic is not None and self.dynamic.rows == rows else None
        return next((f for f in (self, self.solo, self.wide) if f is not None and f.rows == rows),
                    None)

    def tiles(self, key_block: int) -> list[tuple[str, int, int]]:
        """(tensor, rows, width) of the TMA tile each descriptor moves: a warpgroup's rows of
        ``a``, one key block of ``b`` and of ``c``, and a warpgroup's output tile where the
        form stores it by TMA (``o_store``)."""
        (a, b, c), (width, cols) = self.streamed, self.widths
        out = [(self.o_store.tensor, ROWS, self.o_store.width)] if self.o_store else []
        return [(a, ROWS, width), (b, key_block, width), (c, key_block, cols), *out]

    def ring_bytes(self, key_block: int, stages: int) -> int:
        """Shared memory of the row tiles and a ``stages``-deep ring of key blocks."""
        (width, cols), size = self.widths, 2  # 16-bit inputs
        return size * (self.rows * width + stages * key_block * (width + cols))

    @property
    def default_key_block(self) -> int:
        """The key block of a config that names none: the column width where offered."""
        return self.widths[1] if self.widths[1] in self.key_blocks else self.key_blocks[0]

    def tma_store_fits(self, key_block: int, stages: int) -> bool:
        """Whether the TMA store's output buffers (a warpgroup's tile each) fit beside the
        row tiles and the ring -- the launcher's ``TMA_O`` (at width 128 a 3-deep ring of
        128-key blocks leaves no room) -- as many programs per SM as hold without them."""
        if self.o_store is None:
            return False
        need = self.ring_bytes(key_block, stages) + 2 * self.rows * self.o_store.width
        if self.consumers >= 2:
            return need <= SMEM_BYTES
        return self.programs_per_sm(key_block, stages) * (need + 1024) <= SM_SMEM

    @property
    def descs(self) -> tuple[str, ...]:
        """The kernel's descriptor parameters, one per entry of ``tiles``."""
        return ("a_desc", "b_desc", "c_desc") + (("o_desc",) if self.o_store else ())

    def rings(self, key_block: int) -> tuple[int, ...]:
        """Ring depths worth timing: 64-key blocks at 2 deep only (3 deep was within 1% on
        every narrow-range case -- window, documents, jagged; H200,
        bench/results/gluon_s19/key_blocks_h200.json -- and each Gluon config costs
        seconds of compile in a cold superoptimize)."""
        return (2, 3) if key_block == 128 else (2,)
