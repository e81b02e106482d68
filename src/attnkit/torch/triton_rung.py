"""The "triton" rung: the torch autograd op of ``attnkit.torch.op`` with every call
forced onto the Triton kernels (``attnkit.torch.triton_kernels``), on CUDA tensors or
on CPU tensors under ``TRITON_INTERPRET=1``. ``backend="auto"`` already sends CUDA
tensors there; ask for ``backend="triton"`` to test the kernels on the CPU.

>>> from attnkit.torch import triton_rung
>>> isinstance(triton_rung.unavailable(), (str, type(None)))
True
"""

from __future__ import annotations

from . import op


def not_supported_reasons(spec) -> list[str]:
    return op.reasons_for(spec, "triton")


def rung_forward(spec, need_weights: bool = False):
    return op.forward(spec, need_weights, "triton")


def rung_backward(spec, dout, out, lse):
    return op.backward(spec, dout, out, lse, "triton")


def rung_weights(spec, lse=None, rows=None):
    return op.weights(spec, lse, rows)


def unavailable():
    """Why the kernels cannot run here, or None."""
    mod, why = op.triton_module()
    return why if mod is None else mod.available()
