"""``attention_kvcache`` for torch tensors beside the op's own path: under
torch.compile one custom op, ``torch.ops.attnkit.attention_kvcache``, that writes the
cache and runs the eager call when the graph runs (:func:`kvcache_traced`;
:mod:`attnkit.api` calls it while a graph is traced; its flat arguments follow
:mod:`.op`'s table order); and the kept step of a decoding loop on CPU tensors
(:func:`step`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .. import philox
from ..spec import OPTIONS
from .op import _CPU, _UINT64, _direct_reads, _pack, _sinks_at, _unpack, acc_dtype

# ---- attention_kvcache under torch.compile ------------------------------------------------
# A graph cannot read the cache's lengths (the check does) nor run the NumPy rungs, so a
# traced call is one custom op that writes the cache (declared: the graph knows k_cache
# and v_cache change) and runs the whole eager call — check, append, rung — when the
# graph runs. Its arguments: the cache call's tensors, the options attention_kvcache
# takes in the table's order (the window as two ints, the seed as an int), the backend.
_KV_OPTIONS = tuple(o for o in OPTIONS if o.kvcache)
_KV_SCHEMA = ", ".join(
    ["Tensor q", "Tensor(a!) k_cache", "Tensor(b!) v_cache", "Tensor cache_lengths", "Tensor? block_table",
     "Tensor? k_new", "Tensor? v_new"]
    + [o.schema if o.name == "window" else f"{'int?' if o.name == 'seed' else o.schema} {o.name}"
       for o in _KV_OPTIONS]
    + ["str backend"])


def _kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_lengths: torch.Tensor,
             block_table: Any, k_new: Any, v_new: Any, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    from ..api import attention_kvcache
    opts, i = _unpack(_KV_OPTIONS, args, 0, lambda x: x % _UINT64)
    out, lse = attention_kvcache(q, k_cache, v_cache, cache_lengths, block_table=block_table, k_new=k_new,
                                 v_new=v_new, return_lse=True, backend=args[i], **opts)
    return out.contiguous(), lse.contiguous()


def _kvcache_fake(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *rest: Any
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, L = q.shape[:3]
    return q.new_empty((B, H, L, v_cache.shape[-1])), q.new_empty((B, H, L), dtype=acc_dtype(q))


attention_kvcache = torch.library.custom_op("attnkit::attention_kvcache", _kvcache,
                                            mutates_args=("k_cache", "v_cache"),
                                            schema=f"({_KV_SCHEMA}) -> (Tensor, Tensor)")
attention_kvcache.register_fake(_kvcache_fake)


def kvcache_traced(q: Any, k_cache: Any, v_cache: Any, cache_lengths: Any, block_table: Any, k_new: Any,
                   v_new: Any, backend: str, masking: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of attention_kvcache while torch.compile traces: the check of every
    argument but the lengths' and the block table's values (those are checked when
    the graph runs, by the eager call inside the op), then one node of the op above
    with the checked options (the window and seed in normal form)."""
    from ..spec.kvcache import validate_kvcache
    from ..spec.validate import torch_numbers
    masking = torch_numbers(q, masking)                  # sinks=0.5: the op takes tensors
    kv = validate_kvcache(q, k_cache, v_cache, cache_lengths, block_table=block_table, k_new=k_new,
                          v_new=v_new, backend=backend, **masking)
    spec = kv.spec
    def value(o: Any) -> Any:
        if o.name == "seed":
            return None if spec.seed is None else philox.int64(int(spec.seed))
        return masking.get(o.name) if o.schema == "Tensor?" else getattr(spec, o.name)   # the user's tensors
    args = _pack(_KV_OPTIONS, value)
    return torch.ops.attnkit.attention_kvcache(q, k_cache, v_cache, kv.cache_lengths, block_table, k_new, v_new,
                                               *args, backend)   # cache_lengths as (B,): an int taken too


# ---- a decoding loop's kept step ------------------------------------------------------
_INTS = {torch.int64: 8, torch.int32: 4}
_Tensor, _bump = torch.Tensor, torch.autograd.graph.increment_version


def step(rung: Any, kv: Any) -> Callable[..., Any] | None:
    """For calls of kv's signature on CPU tensors (kept by
    :func:`attnkit.spec.kvcache.kept_step` once a call of that signature has run), the
    whole call — the lengths' check, the append, the attention — as one compiled call
    on the tensors' memory (the rung's :meth:`~.op.TorchRung.kvcache_call`):
    ``step(q, k_cache, v_cache, cache_lengths, block_table, k_new, v_new, sinks,
    need_lse) -> (out, lse or None)``, or None where that call cannot take them as
    they are (what the op's kept calls decline, lengths not an int or an int64 or
    int32 CPU tensor of one or B elements, a block table not int64 or int32; what
    :func:`attnkit.small.kvcache_at` declines): the full path then checks and runs
    the call. The caches' version counters move where it writes, as torch's own
    writes move them. The caller has checked the caches' writability (validation
    checks it at every call); tensors that require grad under grad mode are declined
    (the full path names them)."""
    call = rung.kvcache_call(kv)
    if call is None or not kv.spec.q.is_cpu:
        return None
    spec = kv.spec
    out_shape, lse_shape, B = spec.out_shape, spec.lse_shape, spec.batch[0]
    sink_shape = None if spec.sinks is None else spec.shapes["sinks"]      # as the caller gives them
    new = functools.partial(torch.empty, dtype=torch.float32, device=_CPU)
    no_rows = (0, 0, 0, 0)

    def run(q: Any, k: Any, v: Any, lengths: Any, table: Any, k_new: Any, v_new: Any, sinks: Any,
            need_lse: bool) -> tuple[torch.Tensor, Any] | None:
        if not _direct_reads(q, k, v) or (k_new is not None and not _direct_reads(k_new, v_new, q)):
            return None
        if table is None:
            pages: tuple[Any, ...] = ()
        elif table.dtype in _INTS and not table.is_neg():              # (its type, shape, device: the
            pages = (table.data_ptr(), _INTS[table.dtype], table.stride())   # signature's)
        else:
            return None
        at = 0 if sinks is None and sink_shape is None else _sinks_at(sinks, sink_shape)
        if type(lengths) is int and abs(lengths) < 1 << 62:         # (an int64 for the call)
            kind, where, apart = 0, lengths, 0
        elif type(lengths) is _Tensor and lengths.dtype in _INTS and lengths.is_cpu and (
                lengths.dim() == 0 or lengths.shape == (B,)) and not lengths.is_neg():
            kind, where, apart = _INTS[lengths.dtype], lengths.data_ptr(), lengths.stride()[0] if lengths.dim() else 0
        else:
            return None
        if at is None:
            return None
        out, lse = new(out_shape), (new(lse_shape) if need_lse else None)
        L_new = 0 if k_new is None else k_new.shape[-2]
        added = (k_new.data_ptr(), k_new.stride(), v_new.data_ptr(), v_new.stride()) if L_new else (0, no_rows, 0,
                                                                                                   no_rows)
        if not call(q.data_ptr(), q.stride(), k.data_ptr(), k.stride(), v.data_ptr(), v.stride(), where,
                    out.data_ptr(), out.stride(), 0 if lse is None else lse.data_ptr(), at, kind, apart, L_new,
                    *added, *pages):
            return None
        if L_new:
            _bump(k)
            _bump(v)
        return out, lse
    return run
