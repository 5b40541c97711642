"""Persistent cache of chosen kernels, keyed by everything that decides the choice.

Key = sha256 of: the input program (names, shapes, dtypes, bodies), the rule files'
contents, the target and GPU name, the options, and the versions of neptune_eq (a hash
of its own source), triton, torch and egglog.  An entry is one file written atomically
(temp file + ``os.replace``), so concurrent processes never see half an entry; the last
writer wins and every writer wrote a complete, equal-keyed value.

Integrity: a file starts with a magic line and the sha256 of its payload; a truncated,
corrupted or foreign file fails the check and is deleted and rebuilt, never used.  An
entry cannot be stale: any change to the package's source, the rules or the library
versions is a new key.  (A hit used to regenerate the kernel source to compare it, ~9 ms
of a ~15 ms warm hit, for what the key already guarantees.)
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import tempfile
from functools import lru_cache
from pathlib import Path

MAGIC = b"neptune_eq-cache-v1\n"


def cache_root() -> Path:
    base = os.environ.get("NEPTUNE_EQ_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "neptune_eq")
    return Path(base)


@lru_cache(maxsize=1)
def _versions() -> dict:
    import triton
    import torch
    try:
        from importlib.metadata import version
        egg = version("egglog")
    except Exception:  # noqa: BLE001 - egglog missing from metadata: still a valid key part
        egg = "unknown"
    h = hashlib.sha256()
    pkg = Path(__file__).parents[1]  # the whole package: any source change is a new key
    for f in sorted(pkg.rglob("*.py")):
        h.update(f.read_bytes())
    return {"neptune_eq": h.hexdigest()[:16], "triton": triton.__version__,
            "torch": torch.__version__, "egglog": egg}


def make_key(program, rule_files, target: str, device: str, options: dict) -> str:
    rules = [(Path(f).name, hashlib.sha256(Path(f).read_bytes()).hexdigest()) for f in rule_files]
    from ..ir import canonical_text
    # the environment switches that widen or narrow the timed configs choose too
    env = {k: os.environ.get(k) for k in ("NEPTUNE_EQ_TMA", "NEPTUNE_EQ_WARP_SPECIALIZE")}
    blob = json.dumps({"program": canonical_text(program), "rules": rules, "target": target,
                       "device": device, "options": options, "versions": _versions(),
                       "env": env, "walks": lowering_switches()},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def lowering_switches() -> dict:
    """The lowering's module switches (whether a row max is taken before its scale;
    whether a score term linear in the key index splits off a per-block shift; how Gluon
    tiles are walked, how many consumers a program has, whether they take turns, whether
    each computes only its rows' key blocks, whether the output goes by TMA; whether an
    output at a computed index may be added into atomically: not under torch's
    deterministic algorithms; and whether its adds are summed along diagonals, and per
    entry, first).  The benches flip them to A/B a form in one process; a kernel chosen
    under one setting is not the kernel the other emits, so a cache entry must not serve
    both."""
    from ..lowering import (block_shift, gluon_epilogue, gluon_sums, gluon_tiles, gluon_ws,
                            index_scatter, lower, saturated_index)
    return {"max_before_scale": lower.MAX_BEFORE_SCALE, "block_shift": block_shift.ENABLED,
            "ws_persistent": gluon_ws.PERSISTENT, "ws_scheduled": gluon_ws.SCHEDULED,
            "ws_dynamic": gluon_ws.DYNAMIC, "ws_pingpong": gluon_ws.PINGPONG,
            "ws_dynamic_timed": gluon_ws.DYNAMIC_TIMED, "ws_dynamic_keys": gluon_ws.DYNAMIC_KEYS,
            "ws_dynamic_heads_first": gluon_tiles.DYNAMIC_HEADS_FIRST,
            "ws_solo": gluon_ws.SOLO, "ws_wide": gluon_ws.WIDE,
            "ws_own_blocks": gluon_ws.OWN_BLOCKS, "ws_own_past_rows": gluon_ws.OWN_PAST_ROWS,
            "ws_own_consumers": gluon_ws.OWN_CONSUMERS,
            "ws_tma_store": gluon_epilogue.TMA_STORE,
            "sums_persistent": gluon_sums.PERSISTENT,
            "index_scatter": index_scatter.allowed(), "diagonal_adds": index_scatter.DIAGONALS,
            "entry_sums": index_scatter.ENTRY_SUMS, "far_index": saturated_index.ENABLED}


def _path(key: str) -> Path:
    return cache_root() / "winners" / key[:2] / f"{key}.bin"


def load(key: str) -> tuple[object | None, str]:
    """(value, status): status is 'hit', 'miss' or 'corrupt entry rebuilt'."""
    path = _path(key)
    try:
        data = path.read_bytes()
    except OSError:  # absent (or unreadable): build it
        return None, "miss"
    ok = data.startswith(MAGIC)
    if ok:
        digest, _, payload = data[len(MAGIC):].partition(b"\n")
        ok = hashlib.sha256(payload).hexdigest().encode() == digest
    if ok:
        try:
            entry = pickle.load(io.BytesIO(payload))
            ok = isinstance(entry, dict) and entry.get("key") == key
        except Exception:  # noqa: BLE001 - any unpickling failure is corruption
            ok = False
    if not ok:
        _discard(path)
        return None, "corrupt entry rebuilt"
    return entry["value"], "hit"


def store(key: str, value) -> Path:
    path = _path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = pickle.dumps({"key": key, "value": value}, protocol=pickle.HIGHEST_PROTOCOL)
    digest = hashlib.sha256(payload).hexdigest().encode()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(MAGIC + digest + b"\n" + payload)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def discard(key: str) -> None:
    _discard(_path(key))


def _discard(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
