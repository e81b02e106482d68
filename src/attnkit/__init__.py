"""attnkit: exact scaled dot-product attention, softmax(q kᵀ / √D) v, on every rung.

>>> import numpy as np, attnkit
>>> attnkit.attention(np.array([[1.0, 0.0]]), np.eye(2), np.array([[10.0, 0], [0, 10]])).round(2)
array([[6.7, 3.3]])
"""

from .api import attention, attention_backward, attention_weights, merge, scaled_dot_product_attention
from .explain import explain

__all__ = ["attention", "attention_backward", "attention_weights", "explain", "merge",
           "scaled_dot_product_attention"]
__version__ = "0.1.0"
