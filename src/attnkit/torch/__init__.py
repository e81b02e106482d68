"""attnkit for PyTorch: the autograd op behind ``attnkit.attention(tensors)`` and the
``MultiheadAttention`` module.

``attnkit.attention`` (and ``attention_backward``, ``attention_weights``) take torch
tensors directly and return tensors on the same device with q's dtype; this package
holds what makes that work (``op``: the ``torch.library`` custom ops around the compute
rung that ``attnkit.backends.select`` chose, CPU through the NumPy rungs, CUDA through
``triton``: the GPU kernels) and :class:`MultiheadAttention`, a drop-in for
``torch.nn.MultiheadAttention(batch_first=True)``.

Importing this package registers the custom ops (``torch.ops.attnkit.attention_fwd``,
``attention_bwd``, ``attention_weights``, and ``attention_kvcache``, which
``attnkit.attention_kvcache`` becomes while torch.compile traces). Under
``torch.compile`` import it before compiling (or make one eager call): Dynamo traces
``attnkit.attention`` down to the op but cannot trace the first import of a rung
module.

>>> import torch, attnkit.torch
>>> mha = attnkit.torch.MultiheadAttention(8, 2)
>>> out, _ = mha(torch.randn(1, 3, 8), torch.randn(1, 3, 8), torch.randn(1, 3, 8), need_weights=False)
>>> out.shape
torch.Size([1, 3, 8])
"""

try:
    import torch as _torch  # noqa: F401
except ImportError:  # pragma: no cover - exercised in a venv without torch
    raise ImportError("attnkit.torch needs PyTorch: pip install 'attnkit[torch]' (for the CPU build: "
                      "pip install torch --index-url https://download.pytorch.org/whl/cpu)") from None

from . import kvcache_op, op
from .mha import MultiheadAttention

__all__ = ["MultiheadAttention", "kvcache_op", "op"]
