"""attnkit: exact scaled dot-product attention, softmax(q kᵀ / √D) v, on every backend.

>>> import numpy as np, attnkit
>>> attnkit.attention(np.array([[1.0, 0.0]]), np.eye(2), np.array([[10.0, 0], [0, 10]])).round(2)
array([[6.7, 3.3]])
"""

import os as _os

from ._version import __version__
from .api import (
                  attention,
                  attention_backward,
                  attention_kvcache,
                  attention_weights,
                  merge,
                  scaled_dot_product_attention,
)
from .explain import explain
from .kvcache import PagedCache

# the process that imported attnkit: a fork child (another pid) never joins libgomp's
# OpenMP team, whose threads stayed in the parent (flash.runtime)
_PID = _os.getpid()

__all__ = ["PagedCache", "__version__", "attention", "attention_backward", "attention_kvcache",
           "attention_weights", "explain", "merge", "scaled_dot_product_attention"]
