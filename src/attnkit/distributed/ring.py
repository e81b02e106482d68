"""Ring attention: exact attention over a sequence split across the ranks of a
``torch.distributed`` process group (context parallelism).

Each of the P ranks holds one shard of the sequence — ``q`` of length L/P and
``k``, ``v`` (and key-padding masks) of length S/P along dim -2. The K/V shards
travel once around the ring with point-to-point sends that overlap the block
compute; every block is computed by :func:`attnkit.attention` on the rank's own
device and the partial ``(out, lse)`` pairs are combined with
:func:`attnkit.merge`. The backward pass runs :func:`attnkit.attention_backward`
per block with the *global* ``out`` and ``lse`` (which gives exactly that block's
share of ``dq`` and the block's ``dk``, ``dv``) and sends the ``dk``/``dv``
accumulators around the ring back to the ranks that own them.

Layouts (``layout=``), shown for P = 2 ranks and a sequence cut into 4 chunks::

    contiguous   rank 0: chunks 0 1        rank 1: chunks 2 3
    zigzag       rank 0: chunks 0 3        rank 1: chunks 1 2

With ``causal=True`` the contiguous layout leaves rank 0 almost idle (its queries
see only its own keys) while the last rank sees everything; zigzag (rank r holds
chunks r and 2P-1-r) gives every rank the same amount of work. Use
:func:`shard` / :func:`unshard` (or :func:`zigzag_shard` / :func:`zigzag_unshard`)
to cut and reassemble sequences in either layout.

Masks: ``causal``, ``window``, ALiBi, ``kv_lengths`` and dropout's counters use
*global* positions: each block is a call whose Spec carries its ``origin`` (the
global row and key of its first element) and ``extent`` (the global lengths), so
no mask is built and blocks that causal/window hide entirely are skipped.
``keep`` / ``drop`` are key-padding masks only, shape ``(..., 1 or H, 1, S/P)``
(or ``(S/P,)``), sharded like ``k``; they travel with ``k`` and ``v``.
``align`` is the global alignment (``diag(i) = i + S − L`` for bottom-right);
for self-attention (L == S) both alignments agree. Sinks are folded into the
softmax once, after the ring. ``bias``, ``q_lengths`` and packed sequences are
not supported.

Memory per rank: the local shards, two K/V(/mask) buffers (the one in use and
the one arriving), the float32/float64 ``(out, lse)`` accumulators and, in the
backward pass, two ``dk``/``dv`` buffers — all O(L/P); plus whatever one block
costs on the rung that computes it (linear in the block for the flash-style
rungs). No rank ever holds a tensor of the full sequence length.

Not verified here: NCCL on GPUs. The code path is the same (tensors stay on the
rank's device, ``batch_isend_irecv`` is NCCL's grouped P2P), but the project's CI
machines have no GPU, so only gloo on CPU is tested.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from attnkit.backends import select
from attnkit.merge import merge as _merge
from attnkit.reference import sink_gradient
from attnkit.spec import (
    ALIGNS,
    RING_LAYOUTS,
    Spec,
    autocast,
    check_flags,
    check_group,
    check_layout,
    check_ring_shard,
    dtype_name,
    validate,
)
from attnkit.spec.validate import check_lengths
from attnkit.torch.op import acc_dtype, seed_tensor

from .layout import plan

LAYOUTS = RING_LAYOUTS
_DTYPE_CODE = {"float16": 1, "bfloat16": 2, "float32": 3, "float64": 4}
_META_LEN = 128  # ints per rank in the one metadata all_gather


# ---------------------------------------------------------------------------
# communication
# ---------------------------------------------------------------------------
class _Ring:
    """Neighbours in ``group`` and one asynchronous "send to next, receive from
    previous" exchange of a flat buffer."""

    def __init__(self, group):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = (self.rank + 1) % self.world
        self.prev = (self.rank - 1) % self.world

    def exchange(self, buf, tag):
        """Post send(buf → next) and recv(← prev); returns (recv buffer, works)."""
        recv = torch.empty_like(buf)
        ops = [dist.P2POp(dist.isend, buf, group=self.group, group_peer=self.next, tag=tag),
               dist.P2POp(dist.irecv, recv, group=self.group, group_peer=self.prev, tag=tag)]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(works):
        for w in works:
            w.wait()


def _pack(*tensors, dtype):
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors])


def _unpack(buf, shapes):
    out, i = [], 0
    for s in shapes:
        n = 1
        for x in s:
            n *= x
        out.append(buf[i:i + n].view(s))
        i += n
    return out


# ---------------------------------------------------------------------------
# validation: local checks, then one all_gather so every rank raises together
# ---------------------------------------------------------------------------
def _float_bits(x):
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _digest(x, dtype):
    """A 63-bit digest of tensor x's values as ``dtype`` (-1 for None): arrays every
    rank must pass alike, compared without sending them (−0.0 as 0.0, every NaN
    alike: equal values, equal digests)."""
    if x is None:
        return -1
    x = x.detach().to(device="cpu", dtype=dtype)
    if x.is_floating_point():
        x = torch.where(torch.isnan(x), torch.full_like(x, float("nan")), x + 0.0)
    data = x.contiguous().numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


# one rank's metadata: an error flag, these fields, then the shapes of _SHAPED
_FIXED = ("dtype", "causal", "layout", "align", "scale", "softcap", "dropout", "seed", "window_left", "window_right",
          "kv_lengths", "alibi_slopes", "sinks")
_SHAPED = ("q", "k", "v", "keep", "alibi_slopes", "sinks", "kv_lengths")
_SEED_AT = 1 + _FIXED.index("seed")
_VALUES = ("kv_lengths", "alibi_slopes", "sinks")     # whose values (digests) every rank shares
_SAME = {"kv_lengths": "each sequence's key length in global positions", "alibi_slopes": "one slope per head",
         "sinks": "one logit per head, shared by every rank's rows"}


def _meta(spec, keep, cfg, seed, world):
    ints = [_DTYPE_CODE.get(dtype_name(spec.q), 0), int(spec.causal), LAYOUTS.index(cfg.layout),
            ALIGNS.index(spec.align), _float_bits(spec.scale), _float_bits(spec.softcap or 0),
            _float_bits(spec.dropout), seed]
    ints += [-1 if w is None else w for w in (spec.window or (None, None))]
    shared_sinks = spec.sinks if spec.sinks is not None and _sinks_shared(spec) else None   # (per row: sharded)
    ints += [_digest(spec.kv_lengths, torch.int64), _digest(spec.alibi_slopes, torch.float64),
             _digest(shared_sinks, torch.float64)] if world > 1 else [-1] * 3
    for t in (spec.q, spec.k, spec.v, keep, spec.alibi_slopes, spec.sinks, spec.kv_lengths):
        shape = () if t is None else tuple(t.shape)
        ints += [len(shape), *shape]
    return ints


def _shape_of(meta, name):
    i = 1 + len(_FIXED)
    for n in _SHAPED:
        nd = meta[i]
        if n == name:
            return tuple(meta[i + 1:i + 1 + nd])
        i += 1 + nd
    raise KeyError(name)


def _validate(q, k, v, keep, drop, cfg, ring, options):
    """Validate the local shard and choose its rung, then agree across the ring (one
    small all_gather, so a bad input on one rank raises on every rank instead of
    hanging the others). Returns (spec, combined key-padding keep mask or None,
    dropout seed or None, the rung)."""
    err, spec, key_keep, seed, rung = None, None, None, 0, None
    try:
        if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
            raise TypeError("q, k, v: ring_attention takes torch tensors (each rank's shard)")
        check_layout(cfg.layout)
        options = dict(options)
        kv_lengths = options.pop("kv_lengths", None)          # global key positions: checked below
        spec = validate(q, k, v, keep=keep, drop=drop, **options)
        key_keep = check_ring_shard(spec, keep, drop, cfg.layout)
        spec = spec.replace(kv_lengths=check_lengths("kv_lengths", kv_lengths, True, spec.batch,
                                                     ring.world * spec.S, "S (the whole sequence)"))
        if spec.dropout > 0:                     # one seed for the whole ring: rank 0's
            seed = int(seed_tensor(spec))
        # one choice for every block of this call, made for a block (extent set: rungs
        # that take only whole problems, the small one, are passed over)
        rung = select(spec.replace(extent=(spec.L, spec.S)))
    except Exception as e:  # noqa: BLE001 - any error (a meta tensor's NotImplementedError too)
        err = e                                  # goes round first: every rank raises, none hangs
    meta = [int(err is not None)]
    if err is None:
        meta += _meta(spec, key_keep, cfg, seed, ring.world)
    if len(meta) > _META_LEN:
        err = err or ValueError(f"q, k, v: too many dims for ring_attention ({[t.ndim for t in (q, k, v)]})")
        meta = [1]
    meta += [-2] * (_META_LEN - len(meta))
    if ring.world > 1:
        device = q.device if isinstance(q, torch.Tensor) and q.device.type != "meta" else "cpu"
        mine = torch.tensor(meta, dtype=torch.int64, device=device)
        everyone = [torch.empty_like(mine) for _ in range(ring.world)]
        dist.all_gather(everyone, mine, group=ring.group)
        everyone = [t.tolist() for t in everyone]
    else:
        everyone = [meta]
    if err is not None:
        raise err
    bad = [r for r, m in enumerate(everyone) if m[0]]
    if bad:
        raise ValueError(f"ring_attention: rank(s) {bad} rejected their inputs (their error says why)")
    for name in ("q", "k", "v"):
        lengths = [_shape_of(m, name)[-2] for m in everyone]
        if len(set(lengths)) > 1:
            raise ValueError(f"{name}: ring_attention needs equal shard lengths along dim -2 on every rank; "
                             f"got lengths {lengths} on ranks 0..{ring.world - 1}")
    for name in _VALUES:                     # global positions, per-head terms: the same everywhere
        at = 1 + _FIXED.index(name)
        differ = [r for r, m in enumerate(everyone) if m[at] != everyone[0][at]]
        if differ and all(_shape_of(m, name) == _shape_of(everyone[0], name) for m in everyone):
            raise ValueError(f"{name}: ring_attention needs the same values on every rank ({_SAME[name]}); "
                             f"rank(s) {differ} pass other values than rank 0")

    def without_seed(m):
        return m[:_SEED_AT] + m[_SEED_AT + 1:]
    differ = [r for r, m in enumerate(everyone) if without_seed(m) != without_seed(everyone[0])]
    if differ:
        raise ValueError(f"ring_attention: rank(s) {differ} pass different shapes, dtype or options than rank 0 "
                         "(q, k, v, keep/drop, alibi_slopes, sinks, kv_lengths shapes, causal, window, align, "
                         "scale, softcap, dropout, layout must match)")
    seed = everyone[0][_SEED_AT] % (1 << 64) if spec.dropout > 0 else None
    return spec, key_keep, seed, rung


# ---------------------------------------------------------------------------
# the autograd function
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class _Config:
    group: object
    layout: str


def _rows(x, b, tail):
    """x[..., b.r0:b.r1, <tail full dims>]."""
    return x[(Ellipsis, slice(b.r0, b.r1)) + (slice(None),) * tail]


def _blocks(spec, cfg, ring, src):
    window = spec.window
    if spec.kv_lengths is not None and spec.align == "bottom_right" and window is not None:
        # a sequence's diagonal i + kv_len[b] − L is at most the plan's i + S − L: the right
        # edge (causal, the window's right) crops loosely, the left one would cut off keys
        # the sequence sees. The blocks apply each sequence's own band.
        window = (None, window[1])
    return plan(ring.rank, src, ring.world, spec.L, spec.S, causal=spec.causal, window=window,
                align=spec.align, layout=cfg.layout)


def _widened(x):
    """A CPU block's half-precision operand in float32: the rung computes in float32
    from the same values either way, and its block out and gradients then come back
    unrounded, to be merged and summed before the one rounding to the input dtype (on
    GPUs the Triton rung's half products stay, as FlashAttention's)."""
    return x.float() if x.device.type == "cpu" and x.dtype in (torch.float16, torch.bfloat16) else x


def _block_spec(spec, kb, vb, mb, b, ring):
    """The Spec of one block: the rank's rows [r0, r1) against keys [c0, c1) of the
    shard in hand, placed in the global problem (origin, extent). Sinks join the
    softmax once, after the ring (see :func:`_fold_sinks`), not in every block."""
    q = _widened(_rows(spec.q, b, 1))
    k, v = _widened(kb[..., b.c0:b.c1, :]), _widened(vb[..., b.c0:b.c1, :])
    return Spec.from_arrays(q, k, v, scale=spec.scale, causal=spec.causal, window=spec.window, align=spec.align,
                            keep=None if mb is None else mb[..., b.c0:b.c1], softcap=spec.softcap,
                            alibi_slopes=spec.alibi_slopes, kv_lengths=spec.kv_lengths, dropout=spec.dropout,
                            seed=spec.seed, origin=(b.gr, b.gc), extent=(ring.world * spec.L, ring.world * spec.S))


def _shards(spec, keep, ring, tag=0):
    """Iterate over (src rank, k, v, keep) of every step, the next shard travelling
    while the current one computes."""
    shapes = [spec.k.shape, spec.v.shape] + ([keep.shape] if keep is not None else [])
    cur = _pack(spec.k, spec.v, *([keep] if keep is not None else []), dtype=spec.q.dtype) if ring.world > 1 else None
    kb, vb, mb = spec.k, spec.v, keep
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        if step < ring.world - 1:
            nxt, works = ring.exchange(cur, tag=tag)
        if step > 0:
            parts = _unpack(cur, shapes)
            kb, vb = parts[0], parts[1]
            mb = parts[2] > 0.5 if keep is not None else None
        yield step, src, kb, vb, mb
        if step < ring.world - 1:
            ring.wait(works)
            cur = nxt


def _fold_sinks(spec, out, lse):
    """The sink logit joins the softmax once: a block with value 0 and lse = sink."""
    if spec.sinks is None:
        return out, lse
    sinks = spec.sinks.to(lse.dtype).broadcast_to(lse.shape)
    return _merge([out, torch.zeros_like(out)], [lse, sinks])


def _forward(spec, keep, cfg, ring, rung):
    acc = acc_dtype(spec.q)
    out = torch.zeros(spec.out_shape, dtype=acc, device=spec.q.device)
    lse = torch.full(spec.lse_shape, float("-inf"), dtype=acc, device=spec.q.device)
    for _, src, kb, vb, mb in _shards(spec, keep, ring):
        for b in _blocks(spec, cfg, ring, src):
            o, l, _ = rung.rung_forward(_block_spec(spec, kb, vb, mb, b, ring))
            ob, lb = _rows(out, b, 1), _rows(lse, b, 0)
            ob[...], lb[...] = _merge([ob, o.to(acc)], [lb, l.to(acc)])
    return _fold_sinks(spec, out, lse)                # out in the accumulation dtype


def _backward(dout, spec, out, lse, keep, cfg, ring, rung):
    q, k, v = spec.q, spec.k, spec.v
    acc = acc_dtype(q)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv_in = dkv_works = None
    for _, src, kb, vb, mb in _shards(spec, keep, ring):
        dkv = torch.zeros(k.numel() + v.numel(), dtype=acc, device=q.device)
        dk, dv = _unpack(dkv, [k.shape, v.shape])
        for b in _blocks(spec, cfg, ring, src):
            g = rung.rung_backward(_block_spec(spec, kb, vb, mb, b, ring), _widened(_rows(dout, b, 1)),
                                   _rows(out, b, 1), _rows(lse, b, 0))
            _rows(dq, b, 1).add_(g.dq)
            dk[..., b.c0:b.c1, :] += g.dk
            dv[..., b.c0:b.c1, :] += g.dv
        if dkv_works is not None:                   # this shard's dk/dv so far, from the previous rank
            ring.wait(dkv_works)
            dkv += dkv_in
        if ring.world > 1:                          # hand it on; it reaches its owner after the last step
            dkv_in, dkv_works = ring.exchange(dkv, tag=1)
    if dkv_works is not None:
        ring.wait(dkv_works)
        dkv = dkv_in
    dk, dv = _unpack(dkv, [k.shape, v.shape])
    dsinks = None
    if spec.sinks is not None:                      # the sink's value is 0: its score gradient is -w·delta
        dsinks = sink_gradient(spec, lse.to(acc), (dout.to(acc) * out.to(acc)).sum(-1)).reshape(spec.sinks.shape)
        if _sinks_shared(spec) and ring.world > 1:   # one logit shared by every rank's rows
            dist.all_reduce(dsinks, group=ring.group)
        dsinks = dsinks.to(spec.sinks.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks


def _sinks_shared(spec):
    """Whether the sinks are logits every rank's rows share (per head: 0-d, 1-D, or a
    last dim of 1 on shards of several rows) rather than per row, sharded like q."""
    shape = spec.shapes["sinks"]
    return len(shape) <= 1 or (shape[-1] == 1 and spec.L > 1)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, keep, spec, cfg, ring, rung):
        spec = spec.replace(q=q, k=k, v=v, sinks=sinks)
        acc, lse = _forward(spec, keep, cfg, ring, rung)
        out = acc.to(q.dtype)
        # the backward's rowsum(dout ∘ out) from out before its rounding to a half type,
        # on the CPU (as the torch op does; on GPUs the rounded out, as FlashAttention)
        ctx.save_for_backward(q, k, v, sinks, acc if q.device.type == "cpu" else out, lse, keep)
        ctx.spec, ctx.cfg, ctx.ring, ctx.rung = spec.replace(q=None, k=None, v=None, sinks=None), cfg, ring, rung
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, sinks, out, lse, keep = ctx.saved_tensors
        spec = ctx.spec.replace(q=q, k=k, v=v, sinks=sinks)
        dq, dk, dv, dsinks = _backward(dout.contiguous(), spec, out, lse, keep, ctx.cfg, ctx.ring, ctx.rung)
        return dq, dk, dv, dsinks, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any = None, *,
                   layout: str = "contiguous", return_lse: bool = False, keep: Any = None, drop: Any = None,
                   **options: Any) -> Any:
    """Exact attention over a sequence sharded across the ranks of ``group``.

    Every rank calls this with its own shard: ``q (..., H, L/P, D)``,
    ``k (..., Hkv, S/P, D)``, ``v (..., Hkv, S/P, Dv)``, cut from the full sequences
    with :func:`shard` in the chosen ``layout`` (``"contiguous"`` or ``"zigzag"``,
    the load-balanced layout for causal attention). Returns this rank's rows of the
    single-device result: ``out (..., H, L/P, Dv)`` and, with ``return_lse=True``,
    ``lse (..., H, L/P)`` (float32; float64 for float64 inputs). Differentiable
    with respect to q, k, v and sinks (``lse`` is not). All ranks must pass the same
    shapes and options; equal shard lengths are required (``ValueError`` otherwise,
    raised on every rank).

    Masking keywords follow :func:`attnkit.attention` with global positions:
    ``causal``, ``window``, ``align`` (L ≠ S is allowed; for L == S both alignments
    agree), ``scale``, ``softcap``, ``alibi_slopes``, ``kv_lengths`` (per sequence,
    in global key positions, the same on every rank), ``sinks`` (per head, or per
    row sharded like q — with one row per rank a last dim of 1 is per row; folded into
    the softmax once), ``dropout`` with ``seed`` (the
    same entries as on one device; without a seed rank 0 draws one from torch's
    generator); ``keep``/``drop`` must be key-padding masks of shape
    ``(..., 1 or H, 1, S/P)`` sharded like ``k``. ``bias``, ``q_lengths`` and packed
    sequences are not supported. A query row that sees no key gives out 0, lse −inf
    and zero gradients. ``group`` defaults to the world.

    Example (each of P processes, after ``torch.distributed.init_process_group``)::

        from attnkit.distributed import ring_attention, shard, unshard
        rank, P = dist.get_rank(), dist.get_world_size()
        q_r, k_r, v_r = (shard(x, rank, P, layout="zigzag") for x in (q, k, v))
        out_r = ring_attention(q_r, k_r, v_r, causal=True, layout="zigzag")
        # out_r == shard(attnkit.attention(q, k, v, causal=True), rank, P, layout="zigzag")

    ``examples/ring_attention.py`` runs this end to end on 4 CPU processes.

    Parameters
    ----------
    q, k, v : torch.Tensor
        This rank's shards (..., H, L/P, D), (..., Hkv, S/P, D), (..., Hkv, S/P, Dv).
    group : torch.distributed.ProcessGroup, optional
        The ring (default: the default group).
    layout : str
        "contiguous" or "zigzag" (how the shards were cut).
    return_lse : bool
        Also return this rank's lse (no gradient).
    keep, drop : torch.Tensor, optional
        Key-padding masks (..., 1 or H, 1, S/P), sharded like k.
    **options
        The masking keywords above (scale, causal, window, align, softcap,
        alibi_slopes, kv_lengths, sinks, dropout, seed).

    Returns
    -------
    out (..., H, L/P, Dv), or (out, lse).
    """
    check_group(group)
    cfg = _Config(group=group, layout=layout)
    ring = _Ring(group)
    check_flags(return_lse=return_lse)
    q, k, v = autocast(q, k, v)                  # as attnkit.attention (torch.autocast)
    spec, key_keep, seed, rung = _validate(q, k, v, keep, drop, cfg, ring, options)
    spec = spec.replace(seed=seed, keep=None, drop=None)
    out, lse = _RingAttention.apply(spec.q, spec.k, spec.v, spec.sinks, key_keep, spec, cfg, ring, rung)
    if spec.two_d:
        out, lse = out[..., 0, :, :], lse[..., 0, :]
    return (out, lse) if return_lse else out
