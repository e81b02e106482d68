"""The worked example: one query wanting "sweet", two keys (apple and cheese), the
example attnkit's first version (its "seed" program) was written around — every
number of the four steps shown by hand.
"""

from __future__ import annotations

from . import text
from .formatting import WIDTH
from .trace import explain

# q = (1, 0) wants "sweet"; apple's key (1, 0) matches it, cheese's (0, 1) does not.
EXAMPLE = dict(q=[[1.0, 0.0]], k=[[1.0, 0.0], [0.0, 1.0]], v=[[10.0, 0.0], [0.0, 10.0]],
               labels=("apple", "cheese"), query_labels=("q",))


def example_trace():
    """The :class:`~attnkit.explain.Trace` of the worked example."""
    ex = EXAMPLE
    return explain(ex["q"], ex["k"], ex["v"], labels=ex["labels"], query_labels=ex["query_labels"])


def worked_example(width: int = WIDTH) -> str:
    """The worked example, step by step with the arithmetic shown.

    >>> text = worked_example()
    >>> "e^0.707 ≈ 2.028" in text and "(6.70, 3.30)" in text
    True
    """
    t = example_trace()
    a, c = EXAMPLE["labels"]
    head = [
        "Attention(Q, K, V) = softmax(Q Kᵀ / √d_k) V  — the worked example",
        "",
        "query  q = (1, 0)            wants 'sweet'",
        f"keys   {a} = (1, 0)   {c} = (0, 1)",
        f"values {a} = (10, 0)  {c} = (0, 10)",
        "",
    ]
    return "\n".join(head + text.arithmetic(t, (), 0, width) + [""] + text.reading(t, (), 0, width))
