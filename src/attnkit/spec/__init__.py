"""The contract in one place: the masking keywords (``options``), the Spec
(``core``), argument validation (``validate``), checks of saved arrays and ring
shards (``checks``), mask geometry (``geometry``) and the FLOP formula (``flops``).

Every user-facing check lives here and runs before any compute; backends receive a
:class:`Spec` and never validate again.
"""

from .checks import (
                     RING_LAYOUTS,
                     check_flags,
                     check_grad_inputs,
                     check_group,
                     check_layout,
                     check_like,
                     check_lse,
                     check_merge,
                     check_ring_shard,
                     check_rows,
                     check_world,
)
from .core import Spec, acc_dtype, autocast, broadcast_to, dtype_name, is_torch, prod, reduce_to
from .flops import flops
from .geometry import band
from .options import OPTIONS, Masking, with_options
from .validate import ALIGNS, BACKENDS, FLOAT_DTYPES, validate, validate_seed

__all__ = ["ALIGNS", "BACKENDS", "FLOAT_DTYPES", "Masking", "OPTIONS", "RING_LAYOUTS", "Spec", "acc_dtype", "autocast",
           "band", "broadcast_to", "check_flags", "check_grad_inputs", "check_group", "check_layout", "check_like",
           "check_lse", "check_merge", "check_ring_shard", "check_rows", "check_world", "dtype_name", "flops",
           "is_torch", "prod", "reduce_to", "validate", "validate_seed", "with_options"]
