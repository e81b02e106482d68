"""explain: the four steps of attention on real numbers, recorded by reference.py's
trace hook — the very code the library runs, never a second copy of the math.

    Step 1  scores  = q kᵀ                 how well each query matches each key
    Step 2  scaled  = scores · scale        1/√D by default, so the softmax does
                                            not saturate as D grows
            2a softcap, 2b bias, 2c ALiBi, 2d excluded keys, 2e masked scores
                                            only when asked for
    Step 3  weights = softmax over keys     each row sums to 1 (less with a sink;
                                            lse is its log-sum-exp)
            3a dropout                      only when asked for
    Step 4  out     = weights v             each output is a blend of the values

The package: :mod:`~attnkit.explain.trace` (:func:`explain` and the :class:`Trace`),
:mod:`~attnkit.explain.text` (the step-by-step text), :mod:`~attnkit.explain.example`
(the worked example), :mod:`~attnkit.explain.sweep` (the common mistakes) and
:mod:`~attnkit.explain.formatting` (numbers and layout). ``attnkit.explain`` the
attribute is the function; this package is ``sys.modules["attnkit.explain"]``.

>>> t = explain([[1.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]], [[10.0, 0.0], [0.0, 10.0]])
>>> t.out.round(2).tolist()
[[6.7, 3.3]]
"""

from .example import EXAMPLE, example_trace, worked_example
from .formatting import WIDTH
from .sweep import entropy, entropy_sweep, mistakes, mistakes_text
from .text import STEP_TITLES, step_title
from .trace import MAX_SCORES, Trace, check_size, explain

__all__ = ["EXAMPLE", "MAX_SCORES", "STEP_TITLES", "Trace", "WIDTH", "check_size", "entropy",
           "entropy_sweep", "example_trace", "explain", "mistakes", "mistakes_text", "step_title",
           "worked_example"]
