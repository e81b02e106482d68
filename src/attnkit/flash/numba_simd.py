"""Explicit float32 vectors in numba code: the vector type, loads and stores (whole or
the first n lanes), lane arithmetic, lane sums and a vector exp (:func:`exp2v`, the
scalar exp's rule: :data:`EXP2_POLY`). The decoding kernels' products and row passes
are written with them in :mod:`.numba_products`.

A vector (``f32v``) has :data:`LANES` lanes: the machine's widest, 16 where numba
compiles for AVX-512 (32 registers of 16 floats), else 8 (AVX2's 16 registers of 8).
16-lane vectors on a machine without AVX-512 are split by LLVM into pairs, which the
products' register tiles, sized for 32 registers, then spill to memory (on a Zen 3
host the small kernels ran at a quarter of the FMA units' rate: docs/decisions.md).

Operands are addresses (``address(arr, idx)``) with byte strides between rows; rows
are float32 with unit stride. ``load_part``/``store_part`` touch only the first n lanes
(a head dim that is not a multiple of LANES). Every sum runs in an order fixed when the
kernels compile (``fma`` is a multiply-add, fused where the machine has FMA; compiled
with reassociation, LLVM may regroup them, once), so results are the same whatever the
thread count (on one machine: the lane count fixes the order too). Vectors live in
local variables (registers), never in lists, arrays or tuples kept in memory: numba
does not align such storage for them.

Developers: numba's disk cache follows a function's own file: after editing this one,
delete ``__pycache__/numba_*.nb*`` (the kernels inline it). The cache does not know
LANES: ``ATTNKIT_SIMD_LANES`` (8 or 16) overrides the machine's choice only with a
``NUMBA_CACHE_DIR`` of its own (tests/flash/test_simd.py runs the other width so).
"""

from __future__ import annotations

import os

import numba
import numpy as np
from llvmlite import binding, ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model


def compiles_avx512() -> bool:
    """Whether numba compiles with AVX-512F: NUMBA_CPU_FEATURES where set, else the
    host's features (numba's own reading, which gives none where LLVM cannot read
    them) — the features its cache keys compiled code by."""
    features = numba.config.CPU_FEATURES
    if features is None:
        from numba.core.codegen import get_host_cpu_features
        features = get_host_cpu_features()
    return "+avx512f" in features.split(",")


def _lanes() -> int:
    """16 where numba compiles with AVX-512F, else 8 (``ATTNKIT_SIMD_LANES`` overrides;
    see the module's note on the cache)."""
    forced = os.environ.get("ATTNKIT_SIMD_LANES", "")
    if forced in ("8", "16"):
        return int(forced)
    return 16 if compiles_avx512() else 8


LANES = _lanes()
_F, _I32, _I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
_V = ir.VectorType(_F, LANES)
_MASK = ir.VectorType(ir.IntType(1), LANES)
_VN = f"v{LANES}f32"                                    # the vector type in intrinsics' names
# llvm.masked.* are named by their pointer type: "p0" where LLVM has only opaque pointers
# (17 on), "p0v16f32" (16 lanes) before (LLVM renames either on parsing, where it can)
_MASKED = f".{_VN}.p0" if binding.llvm_version_info[0] >= 17 else f".{_VN}.p0{_VN}"
# the compiled kernels' flags (here and in .numba_kernels). No "arcp" in either: a
# division stays a division (finishing, inlined into the tile loop, divides by each
# row's sum; with arcp it became a reciprocal times x, 1 ulp off)
ORDERED = dict(nogil=True, cache=True, error_model="numpy", fastmath={"nsz", "contract", "afn"})
REDUCE = dict(ORDERED, fastmath={"reassoc", "nsz", "contract", "afn"})
# exp as 2^t (t = x · log2 e): 2^t = 2^n · 2^r with n = round(t), r = t − n, |r| ≤ 1/2,
# 2^r by Horner's rule on these coefficients, highest first (near-minimax for
# (2^r − 1) / r, ≤ 2 ulp); below EXP2_MIN the result is exactly 0. One rule for the
# scalar exp (numba_kernels.exp2_f32) and the vector one (:func:`exp2v`)
EXP2_POLY = (1.5356125e-4, 1.3398818e-3, 9.6184276e-3, 5.5503327e-2, 2.4022648e-1, 6.9314718e-1)
EXP2_MIN = -125.0
LOG2E = 1.44269504088896341


class F32Vec(types.Type):
    """numba's type of a LANES-lane float32 vector (an LLVM <LANES x float> value)."""

    def __init__(self) -> None:
        super().__init__(name=f"f32x{LANES}")


f32v = F32Vec()


@register_model(F32Vec)
class _VectorModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _V)


def _at(builder, addr, ty=_V):
    return builder.inttoptr(addr, ty.as_pointer())


def _lanes_below(builder, n):
    # the mask of lanes i < n
    wide = ir.VectorType(_I64, LANES)
    nv = builder.insert_element(ir.Constant(wide, ir.Undefined), n, _I32(0))
    nv = builder.shuffle_vector(nv, nv, ir.Constant(ir.VectorType(_I32, LANES), [0] * LANES))
    return builder.icmp_signed("<", ir.Constant(wide, list(range(LANES))), nv)


def _function(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


@intrinsic
def address(typingctx, arr, idx):
    """The address of arr[idx] for a float32 array (idx: a tuple of ints, one per
    dimension, none negative); anything else does not compile."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.float32 and isinstance(idx, types.BaseTuple)
            and len(idx) == arr.ndim and all(isinstance(t, types.Integer) for t in idx)):
        return None
    def codegen(context, builder, sig, args):
        aty, ity = sig.args
        ary = context.make_array(aty)(context, builder, args[0])
        inds = [context.cast(builder, x, t, types.intp) for x, t in zip(cgutils.unpack_tuple(builder, args[1]), ity)]
        ptr = cgutils.get_item_pointer(context, builder, aty, ary, inds)
        return builder.ptrtoint(ptr, context.get_value_type(types.intp))
    return types.intp(arr, idx), codegen


@intrinsic
def prefetch(typingctx, addr):
    """llvm.prefetch (read, locality 2: into L2, not L1) of the line at addr; never
    faults and changes no value. A chunk's rows prefetched into L1 (locality 3) pushed
    out the scores, q and the output rows there: on a Zen 4 host, decoding from memory
    ran 1.2–1.4× faster on one thread and 1.05–1.6× on two with L2 (docs/decisions.md)."""
    def codegen(context, builder, sig, args):
        i8p = ir.IntType(8).as_pointer()
        fn = builder.module.declare_intrinsic("llvm.prefetch", [i8p], ir.FunctionType(ir.VoidType(),
                                                                                      [i8p, _I32, _I32, _I32]))
        builder.call(fn, [builder.inttoptr(args[0], i8p), _I32(0), _I32(2), _I32(1)])
        return context.get_dummy_value()
    return types.none(types.intp), codegen


@numba.njit(**REDUCE, inline="always")
def prefetch_bytes(p, n):
    """:func:`prefetch` every 64-byte line of the n bytes at p."""
    for o in range(0, n, 64):
        prefetch(p + o)


@intrinsic
def get(typingctx, addr):
    """The float32 at addr."""
    def codegen(context, builder, sig, args):
        return builder.load(_at(builder, args[0], _F), align=4)
    return types.float32(types.intp), codegen


@intrinsic
def put(typingctx, addr, x):
    """Store the float32 x at addr."""
    def codegen(context, builder, sig, args):
        builder.store(context.cast(builder, args[1], sig.args[1], types.float32), _at(builder, args[0], _F), align=4)
        return context.get_dummy_value()
    return types.none(types.intp, x), codegen


@intrinsic
def load(typingctx, addr):
    """LANES float32 from addr."""
    def codegen(context, builder, sig, args):
        return builder.load(_at(builder, args[0]), align=4)
    return f32v(types.intp), codegen


@intrinsic
def load_part(typingctx, addr, n):
    """Lanes [0, n) from addr (all for n ≥ LANES, none for n ≤ 0), the others 0;
    nothing past lane n − 1 is read."""
    def codegen(context, builder, sig, args):
        fn = _function(builder, "llvm.masked.load" + _MASKED, _V, [_V.as_pointer(), _I32, _MASK, _V])
        n = context.cast(builder, args[1], sig.args[1], types.int64)
        zero = ir.Constant(_V, [0.0] * LANES)
        return builder.call(fn, [_at(builder, args[0]), _I32(4), _lanes_below(builder, n), zero])
    return f32v(types.intp, n), codegen


@intrinsic
def store(typingctx, addr, x):
    """Store the LANES lanes of x at addr."""
    def codegen(context, builder, sig, args):
        builder.store(args[1], _at(builder, args[0]), align=4)
        return context.get_dummy_value()
    return types.none(types.intp, f32v), codegen


@intrinsic
def store_part(typingctx, addr, x, n):
    """Store lanes [0, n) of x at addr (as :func:`load_part` counts them); nothing past
    them is written."""
    def codegen(context, builder, sig, args):
        fn = _function(builder, "llvm.masked.store" + _MASKED, ir.VoidType(), [_V, _V.as_pointer(), _I32, _MASK])
        n = context.cast(builder, args[2], sig.args[2], types.int64)
        builder.call(fn, [args[1], _at(builder, args[0]), _I32(4), _lanes_below(builder, n)])
        return context.get_dummy_value()
    return types.none(types.intp, f32v, n), codegen


@intrinsic
def splat(typingctx, x):
    """x (a float32) in every lane."""
    def codegen(context, builder, sig, args):
        x = context.cast(builder, args[0], sig.args[0], types.float32)
        v = builder.insert_element(ir.Constant(_V, ir.Undefined), x, _I32(0))
        return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, LANES), [0] * LANES))
    return f32v(x), codegen


@intrinsic
def fma(typingctx, a, b, c):
    """a · b + c lane by lane (llvm.fmuladd: fused where the machine has FMA)."""
    def codegen(context, builder, sig, args):
        return builder.call(_function(builder, f"llvm.fmuladd.{_VN}", _V, [_V, _V, _V]), args)
    return f32v(f32v, f32v, f32v), codegen


def _binary(op):
    """An intrinsic f(a, b) → f32v: the IR builder's float op ``op`` lane by lane
    (no fast-math flags: each lane rounds as written)."""
    @intrinsic
    def f(typingctx, a, b):
        def codegen(context, builder, sig, args):
            return getattr(builder, op)(args[0], args[1])
        return f32v(f32v, f32v), codegen
    return f


vadd, vsub, vmul = _binary("fadd"), _binary("fsub"), _binary("fmul")


def _maxnum(builder, a, b, fastmath=("nnan", "nsz")):
    # llvm.maxnum, with nnan (vmaxps) as numba_kernels._fmax: a NaN lane may be skipped
    return builder.call(_function(builder, f"llvm.maxnum.{_VN}", _V, [_V, _V]), [a, b], fastmath=fastmath)


@intrinsic
def vmax(typingctx, a, b):
    """max(a, b) lane by lane (a NaN lane may be skipped, as the scalar row max does)."""
    def codegen(context, builder, sig, args):
        return _maxnum(builder, args[0], args[1])
    return f32v(f32v, f32v), codegen


@intrinsic
def hmax(typingctx, a):
    """max over a's lanes."""
    def codegen(context, builder, sig, args):
        x, size = args[0], LANES // 2
        while size:
            lanes = [(i + size) % LANES for i in range(LANES)]
            x = _maxnum(builder, x, builder.shuffle_vector(x, x, ir.Constant(ir.VectorType(_I32, LANES), lanes)))
            size //= 2
        return builder.extract_element(x, _I32(0))
    return types.float32(f32v), codegen


@intrinsic
def fill_from(typingctx, x, n, value):
    """x with its lanes from n on (none for n ≥ LANES, all for n ≤ 0) set to value."""
    def codegen(context, builder, sig, args):
        n = context.cast(builder, args[1], sig.args[1], types.int64)
        y = context.cast(builder, args[2], sig.args[2], types.float32)
        v = builder.insert_element(ir.Constant(_V, ir.Undefined), y, _I32(0))
        v = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, LANES), [0] * LANES))
        return builder.select(_lanes_below(builder, n), args[0], v)
    return f32v(f32v, n, value), codegen


@intrinsic
def is_neginf(typingctx, x):
    """1.0 in the lanes where x is −inf, else 0.0."""
    def codegen(context, builder, sig, args):
        hit = builder.fcmp_ordered("==", args[0], ir.Constant(_V, [float("-inf")] * LANES))
        return builder.uitofp(hit, _V)
    return f32v(f32v), codegen


@intrinsic
def exp2v(typingctx, t):
    """2^t lane by lane by :data:`EXP2_POLY`'s rule, the same operations as the scalar
    ``numba_kernels.exp2_f32``: the same bits for the same t ≤ 0 (what the softmax
    gives; 0 below EXP2_MIN and for −inf, NaN stays NaN; n is held to [−127, 127])."""
    def codegen(context, builder, sig, args):
        t = args[0]
        const = lambda c: ir.Constant(_V, [c] * LANES)
        floor = _function(builder, f"llvm.floor.{_VN}", _V, [_V])
        fmuladd = _function(builder, f"llvm.fmuladd.{_VN}", _V, [_V, _V, _V])
        n = builder.call(floor, [builder.fadd(t, const(0.5))])
        r = builder.fsub(t, n)
        p = const(EXP2_POLY[0])
        for c in EXP2_POLY[1:] + (1.0,):
            p = builder.call(fmuladd, [p, r, const(c)])
        # 2^n from its exponent bits; n held in [−127, 127] first (no conversion of an
        # infinite or NaN n: those lanes are 0 or NaN by the select or by r)
        n = builder.call(_function(builder, f"llvm.minnum.{_VN}", _V, [_V, _V]),
                         [_maxnum(builder, n, const(-127.0), ()), const(127.0)])
        iv = ir.VectorType(_I32, LANES)
        bits = builder.shl(builder.add(builder.fptosi(n, iv), ir.Constant(iv, [127] * LANES)),
                           ir.Constant(iv, [23] * LANES))
        y = builder.fmul(p, builder.bitcast(bits, _V))
        return builder.select(builder.fcmp_ordered("<", t, const(EXP2_MIN)), const(0.0), y)
    return f32v(f32v), codegen


def _pairs(builder, a, b, size):
    # lanes of blocks of 2·size: the low size of each block plus its high size, a's
    # blocks first, then b's (so a vector of one row's partial sums becomes half as many)
    n = a.type.count
    lo = [i for i in range(n) if (i // size) % 2 == 0]
    hi = [i for i in range(n) if (i // size) % 2 == 1]
    x = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, n), lo + [n + i for i in lo]))
    y = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, n), hi + [n + i for i in hi]))
    return builder.fadd(x, y)


def _sums(builder, xs):
    # the lane sums of len(xs) ∈ {1, 2, 4, …, LANES} vectors, in one vector's first lanes (in order)
    size = LANES // 2
    while len(xs) > 1:
        xs = [_pairs(builder, xs[i], xs[i + 1], size) for i in range(0, len(xs), 2)]
        size //= 2
    x = xs[0]
    while size:                                  # one vector's lanes: pairs within itself
        x = _pairs(builder, x, x, size)
        size //= 2
    return x


@intrinsic
def sum4(typingctx, a, b, c, d):
    """(Σ a, Σ b, Σ c, Σ d) over lanes, in a fixed order."""
    def codegen(context, builder, sig, args):
        x = _sums(builder, list(args))
        return context.make_tuple(builder, sig.return_type, [builder.extract_element(x, _I32(i)) for i in range(4)])
    return types.UniTuple(types.float32, 4)(f32v, f32v, f32v, f32v), codegen


@intrinsic
def hsum(typingctx, a):
    """Σ a over lanes, in a fixed order."""
    def codegen(context, builder, sig, args):
        return builder.extract_element(_sums(builder, [args[0]]), _I32(0))
    return types.float32(f32v), codegen


@intrinsic
def put_sums4(typingctx, p, st, *xs):
    """Row i's c sums Σ x[c·i + j] (j < c) over lanes stored at p + i·st (bytes), for
    4·c vectors x, c = LANES / 4 (four rows by c keys of scores): 4c − 1 pairwise
    steps instead of 4c separate sums."""
    if len(xs) != LANES or any(t != f32v for t in xs):
        return None
    c = LANES // 4

    def codegen(context, builder, sig, args):
        p, st = args[0], args[1]
        x = _sums(builder, cgutils.unpack_tuple(builder, args[2]))
        row = ir.VectorType(_F, c)
        for i in range(4):
            part = builder.shuffle_vector(x, x, ir.Constant(ir.VectorType(_I32, c), [c * i + j for j in range(c)]))
            builder.store(part, _at(builder, builder.add(p, builder.mul(st, _I64(i))), row), align=4)
        return context.get_dummy_value()
    return types.none(types.intp, types.intp, types.StarArgTuple([f32v] * LANES)), codegen


if LANES == 16:
    @numba.njit(**REDUCE, inline="always")
    def _probe_sums(p, st, x, a, b, c):
        # put_sums4 of a, b, c, a and x's rows 4 … LANES − 1
        put_sums4(p, st, a, b, c, a, load(address(x, (4, 0))), load(address(x, (5, 0))), load(address(x, (6, 0))),
                  load(address(x, (7, 0))), load(address(x, (8, 0))), load(address(x, (9, 0))),
                  load(address(x, (10, 0))), load(address(x, (11, 0))), load(address(x, (12, 0))),
                  load(address(x, (13, 0))), load(address(x, (14, 0))), load(address(x, (15, 0))))
else:
    @numba.njit(**REDUCE, inline="always")
    def _probe_sums(p, st, x, a, b, c):
        put_sums4(p, st, a, b, c, a, load(address(x, (4, 0))), load(address(x, (5, 0))), load(address(x, (6, 0))),
                  load(address(x, (7, 0))))


@numba.njit(**REDUCE)
def _probe(x, out):
    # every intrinsic once, on x (16, LANES) into out (8, LANES): see works()
    a, b = load(address(x, (0, 0))), load_part(address(x, (1, 0)), 5)
    c = fma(a, splat(2.0), b)
    store_part(address(out, (0, 0)), c, 7)
    store(address(out, (1, 0)), c)
    _probe_sums(address(out, (2, 0)), out.strides[0], x, a, b, c)
    prefetch(address(x, (3, 0)))
    put(address(out, (6, 0)), get(address(x, (2, 3))))
    store(address(out, (7, 0)), vadd(exp2v(b), vmul(vsub(a, c), fill_from(a, LANES // 2 + 1, -1.0))))
    return sum4(a, b, c, a), hsum(c), hmax(vmax(a, fill_from(c, LANES - 1, 100.0))), \
        hsum(is_neginf(fill_from(a, 6, -np.inf)))


def works() -> bool:
    """Whether this numba and LLVM compile the intrinsics and get them right (else the
    callers keep their other paths: :func:`.kernels._probed`)."""
    x = (np.arange(16 * LANES, dtype=np.float32).reshape(16, LANES) % 7 - 3).astype(np.float32)   # exact sums
    out = np.full((8, LANES), -1.0, dtype=np.float32)
    try:
        s4, h, top, neginf = _probe(x, out)
    except Exception:                       # noqa: BLE001 — any compile error: not here
        return False
    lanes, c4 = np.arange(LANES), LANES // 4
    b = np.where(lanes < 5, x[1], 0)
    c = 2 * x[0] + b
    rows = np.stack([x[0], c - 2 * x[0], c, x[0]] + list(x[4:LANES]))
    last = 2.0 ** b + (x[0] - c) * np.where(lanes < LANES // 2 + 1, x[0], -1)    # powers of 2, integers: exact
    return bool(np.array_equal(out[0], np.where(lanes < 7, c, -1)) and np.array_equal(out[1], c)
                and np.array_equal(out[2:6, :c4], rows.sum(axis=1).reshape(4, c4)) and np.all(out[2:6, c4:] == -1)
                and out[6, 0] == x[2, 3] and np.array_equal(out[7], last) and s4 == tuple(rows[:4].sum(axis=1))
                and h == c.sum() and top == 100 and neginf == LANES - 6)
