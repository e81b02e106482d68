"""``attention_kvcache`` under torch.compile: one custom op,
``torch.ops.attnkit.attention_kvcache``, that writes the cache and runs the eager call
when the graph runs (:func:`kvcache_traced`; :mod:`attnkit.api` calls it while a graph
is traced). Its flat arguments follow :mod:`.op`'s table order.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import philox
from ..spec import OPTIONS
from .op import _UINT64, _pack, _unpack, acc_dtype

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
