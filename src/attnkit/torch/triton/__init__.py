"""The triton rung: attnkit's GPU kernels for torch tensors (CUDA; CPU tensors under
``TRITON_INTERPRET=1``), forward and backward, reached through the torch op.

``launch`` is the host side (what the kernels support, their launches), ``forward``
and ``backward`` the kernels, ``device`` their shared device functions, ``kvcache``
and ``decode`` KV-cache decoding (split-KV; host side and kernels), ``aot`` compiling
for a GPU target without one, ``jit`` the lazy ``triton.jit`` wrapping, ``tuning``
the launch table.

>>> from attnkit.torch import triton as rung
>>> isinstance(rung.unavailable(), (str, type(None)))
True
"""

from __future__ import annotations

from typing import Any

from ...backends import Grads
from ...spec import Spec
from . import tuning

name = "triton"
arrays = "torch"          # the torch op hands this rung torch tensors (no NumPy views)

__all__ = ["arrays", "name", "not_supported_reasons", "rung_backward", "rung_forward", "rung_kvcache",
           "rung_weights", "tuning", "unavailable"]


def _kernels() -> Any:
    from . import launch
    return launch


def unavailable() -> str | None:
    """Why the kernels cannot run here, or None."""
    try:
        k = _kernels()
    except ImportError as e:
        return f"triton is not installed ({e})"
    return k.available()


def not_supported_reasons(spec: Spec) -> list[str]:
    try:
        k = _kernels()
    except ImportError as e:
        return [f"attnkit.torch.triton.launch not available: {e}"]
    return list(k.not_supported_reasons(spec))


def rung_forward(spec: Spec, need_weights: bool = False) -> tuple[Any, Any, None]:
    out, lse = _kernels().forward(spec)
    return out, lse, None


def rung_backward(spec: Spec, dout: Any, out: Any, lse: Any, dlse: Any = None, need_dbias: bool = True) -> Grads:
    return Grads(*_kernels().backward(spec, dout, out, lse, dlse, need_dbias=need_dbias))


def rung_kvcache(kv: Any) -> tuple[Any, Any]:
    """attention_kvcache's (out, lse) for a validated KVCall whose cache was appended
    to: split-KV decode kernels over the contiguous or paged cache in place."""
    from . import kvcache
    return kvcache.kvcache(kv)


def rung_weights(spec: Spec, lse: Any = None, rows: Any = None) -> Any:
    """Weights have no Triton kernel: the flash rung computes them on a CPU copy
    (O(rows · S) memory) and they come back to the tensors' device."""
    import torch

    from ... import flash
    from ..op import _np, _torch, numpy_spec
    cpu = spec.replace(**{n: (None if getattr(spec, n) is None else getattr(spec, n).detach().cpu())
                          for n in ("q", "k", "v", "keep", "drop", "bias", "alibi_slopes", "sinks",
                                    "q_lengths", "kv_lengths", "kv_starts", "cu_seqlens_q", "cu_seqlens_k")})
    w = flash.rung_weights(numpy_spec(cpu), None if lse is None else _np(lse.cpu()), rows)
    return _torch(w, spec.q.dtype).to(spec.q.device if isinstance(spec.q, torch.Tensor) else "cpu")
