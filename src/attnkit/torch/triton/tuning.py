"""Block sizes, warps and pipeline stages for the Triton kernels: a plain table.

``config(D, dtype, capability, kind)`` returns ``dict(BLOCK_M, BLOCK_N, num_warps,
num_stages, SPLIT)`` for one kernel launch. No autotuning runs in the default path: the
table is read once per call, so a run is reproducible and starts without a search.

- ``D``: the larger of the query-key and value head dims (before padding).
- ``dtype``: "float16", "bfloat16" or "float32".
- ``capability``: the CUDA compute capability as ``(major, minor)``, or ``None`` for
  Triton's CPU interpreter (``TRITON_INTERPRET=1``).
- ``kind``: "forward", "backward_dkdv" (one program per key block, looping over query
  blocks), "backward_dq" (one program per query block, looping over key blocks),
  "backward_preprocess" (delta = rowsum(dout ∘ out)), "decode" (KV-cache decoding:
  one program per (sequence, kv head, row block, key split); BLOCK_M is the most
  query rows — a GQA group's heads × L — one program takes) or "decode_combine"
  (merging the splits; BLOCK_M rows per program).

``SPLIT_KEYS`` (kind "decode" only): the fewest cache keys per split-KV part; the
split count is :func:`decode_splits`, a function of the shapes alone.

``SPLIT`` (half types only): the float32 weights p and score gradients dS enter the
tensor-core dots as hi + lo, two float16/bfloat16 parts, instead of one rounded
value. The table turns it on for the backward kinds only. There rounding p and dS
once, as FlashAttention-2 does, puts dq, dk and dv above DESIGN.md §6's 2× rule on
random inputs (up to 1.3× the budget, measured under the interpreter), so the split
costs one more dot per rounded product (dK/dV kernel 6 dots instead of 4, dQ kernel
4 instead of 3). The forward rounds p once: its error stays within 0.82× of the
budget over random, causal, masked and sharp (scale = 1) cases at D = 16…128,
S ≤ 2048 in both half types, since the output's own final rounding dominates.

To override, assign a function with the same signature to ``override``; it returns a
dict (any subset of the five keys; the rest come from the table) or ``None`` to keep
the table's entry::

    >>> from attnkit.torch.triton import tuning as triton_tuning
    >>> triton_tuning.override = lambda D, dtype, cap, kind: (
    ...     {"BLOCK_N": 32} if kind == "forward" else None)
    >>> triton_tuning.config(128, "bfloat16", (9, 0), "forward")["BLOCK_N"]
    32
    >>> triton_tuning.override = None

The half-precision GPU entries are starting points from the FlashAttention-2 Triton
designs, measured on an H200 (README.md) but not swept there, except the decode entry
at D <= 128 (the fastest of ``benchmarks/gpu.py --sweep-decode``'s candidates there);
the float32 entries were chosen so that ptxas spills next to no registers for sm_90
(``aot.ptxas_usage``), and checked and timed on an H200 since. ``benchmarks/gpu.py
--sweep`` times a few candidates through ``override`` and prints the best per head dim
and kind.
"""

from __future__ import annotations

KINDS = ("forward", "backward_dkdv", "backward_dq", "backward_preprocess", "decode", "decode_combine")
KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "SPLIT", "SPLIT_KEYS")
# split-KV decoding: a launch aims for this many programs (a fixed number, not the
# device's SM count, so the split count — and every bit of the result — depends on
# the shapes only: about two programs per SM of a 108–132 SM A100/H100; 512 and more
# were slower on an H200, benchmarks/gpu.py --sweep-decode), with at most MAX_SPLITS
# parts per (sequence, kv head, row block)
DECODE_PROGRAMS = 256
MAX_SPLITS = 64

override = None  # user hook: (D, dtype, capability, kind) -> dict | None


def _entry(BLOCK_M, BLOCK_N, num_warps, num_stages):
    return {"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "num_warps": num_warps,
            "num_stages": num_stages}


def default_config(D: int, dtype: str, capability, kind: str) -> dict:
    """The built-in table (see the module docstring for the arguments).

    >>> default_config(128, "bfloat16", (9, 0), "forward")
    {'BLOCK_M': 128, 'BLOCK_N': 64, 'num_warps': 8, 'num_stages': 3, 'SPLIT': False}
    """
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    if kind in ("decode", "decode_combine"):
        return _decode(D, dtype, capability, kind)
    # the same rule on the GPU and in the interpreter: split in the backward only
    return dict(_launch(D, dtype, capability, kind), SPLIT=kind != "forward")


def _decode(D, dtype, capability, kind):
    """The decode kinds' entries: p rounded once like the forward (SPLIT off). Decoding
    reads each key once per GQA group, so its speed is the cache's bandwidth: key tiles
    of 32–128 rows, pipelined; SPLIT_KEYS keeps a split's share of a long sequence to a
    few tiles or more. Half precision at D <= 128 on the large-shared-memory GPUs: the
    fastest of benchmarks/gpu.py --sweep-decode's candidates on an H200 (README);
    the rest are unmeasured."""
    if kind == "decode_combine":
        return dict(_entry(16 if capability is None else 32, 16, 1 if capability is None else 4, 1), SPLIT=False)
    if capability is None:
        return dict(_entry(32, 32, 1, 1), SPLIT=False, SPLIT_KEYS=256)
    big_smem = capability in ((8, 0), (9, 0), (10, 0))
    wide = D > 128 or dtype == "float32"
    if big_smem and not wide:
        return dict(_entry(64, 128, 4, 2), SPLIT=False, SPLIT_KEYS=1024)
    block_n = (16 if D > 128 else 32) if dtype == "float32" else (32 if D > 128 else 64)
    block_m = 64 if not wide else (16 if D > 128 and dtype == "float32" else 32)   # fp32 D=256: ~100 KB at 32
    return dict(_entry(block_m, block_n, 4, 2), SPLIT=False, SPLIT_KEYS=512)


def decode_splits(programs: int, keys: int, split_keys: int) -> int:
    """Split-KV parts per (sequence, kv head, row block) for a decode launch of
    ``programs`` such triples over a cache of ``keys`` positions (its capacity):
    enough parts to reach DECODE_PROGRAMS programs, at most MAX_SPLITS, and none
    shorter than ``split_keys`` keys. Shapes only: the same on every device.

    >>> decode_splits(programs=8, keys=32768, split_keys=1024), decode_splits(4096, 32768, 1024)
    (32, 1)
    """
    by_keys = -(-max(keys, 1) // max(split_keys, 1))
    by_programs = -(-DECODE_PROGRAMS // max(programs, 1))
    return max(1, min(MAX_SPLITS, by_keys, by_programs))


def _launch(D, dtype, capability, kind):
    """Block sizes, warps and stages of default_config."""
    if capability is None:
        # CPU interpreter: its cost is per tile operation, not per element, so
        # mid-size tiles are fastest; tests override to 16 to get more tiles.
        return _entry(32, 32, 1, 1)
    if kind == "backward_preprocess":
        return _entry(64, 64, 4, 1)
    big_smem = capability in ((8, 0), (9, 0), (10, 0))   # A100, H100/H200, B200: >= 164 KB
    hopper = capability in ((9, 0), (10, 0))              # 227 KB: room for a 4th stage
    if dtype == "float32":
        # 4-byte operands without tensor cores (tf32 off): 8 warps and tiles small
        # enough that ptxas (sm_90, Triton 3.6, every feature on) spills at most 56
        # bytes per thread in the plain kernels (the careful variants, run only on
        # non-finite inputs: up to 2.7 KB in dK/dV), all under ~85 KB of shared
        # memory. The half types' tiles, used here before, spilled 4–66 KB: the
        # H200 ran the float32 backward at 0.7 TFLOP/s against the forward's 10.6.
        if D <= 64:
            return {"forward": _entry(64, 32, 8, 1), "backward_dkdv": _entry(32, 32, 8, 1),
                    "backward_dq": _entry(32, 32, 8, 1)}[kind]
        if D <= 128:
            return {"forward": _entry(32, 16, 8, 1), "backward_dkdv": _entry(32, 16, 8, 1),
                    "backward_dq": _entry(32, 16, 8, 1)}[kind]
        return _entry(16, 16, 8, 1)
    if kind == "forward":
        if D <= 64:
            cfg = _entry(128, 64, 4, 4 if hopper else (3 if big_smem else 2))
        elif D <= 128:
            cfg = _entry(128, 64 if big_smem else 32, 8, 3 if big_smem else 2)
        else:
            cfg = _entry(64, 32, 4, 2)
    elif kind == "backward_dkdv":
        if D <= 64:
            cfg = _entry(32, 128, 4, 3 if big_smem else 2)
        elif D <= 128:
            cfg = _entry(32, 128 if big_smem else 64, 8, 2)
        else:
            cfg = _entry(16, 64, 4, 1)
    else:  # backward_dq
        if D <= 64:
            cfg = _entry(128, 32, 4, 3 if big_smem else 2)
        elif D <= 128:
            cfg = _entry(128 if big_smem else 64, 32, 8, 2)
        else:
            cfg = _entry(64, 16, 4, 1)
    return cfg


def config(D: int, dtype: str, capability, kind: str) -> dict:
    """The launch configuration: the table's entry updated by ``override``'s dict."""
    cfg = default_config(D, dtype, capability, kind)
    if override is not None:
        extra = override(D, dtype, capability, kind)
        if extra is not None:
            bad = set(extra) - set(KEYS)
            if bad:
                raise ValueError(f"triton_tuning.override: unknown keys {sorted(bad)}; expected a subset of {KEYS}")
            cfg.update(extra)
    for name in ("BLOCK_M", "BLOCK_N"):
        b = cfg[name]
        if b < 16 or b & (b - 1):
            raise ValueError(f"triton_tuning: {name} must be a power of two >= 16, got {b}")
    return cfg
