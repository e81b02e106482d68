"""Numbers as a person writes them, and the text layout helpers (wrapping, labelled
matrices, JSON values) the rest of :mod:`attnkit.explain` prints with.

NaN and inf are written as such — never as a number, never as an error:

>>> num(1.0), num(0.7071067811865476), num(2e40), num(float("nan")), num(-float("inf"))
('1', '0.707', '2e+40', 'nan', '-inf')
>>> eq(0.5), eq(1 / 3)
('=', '≈')
>>> vec([10.0, 0.0]), vec([6.7, 3.3], 2)
('(10, 0)', '(6.70, 3.30)')
"""

from __future__ import annotations

import math
import re

import numpy as np

WIDTH = 80


def num(x) -> str:
    """A number as a person writes it: integers plainly, others to 3 decimals, very
    large or very small ones with an exponent; 'nan', 'inf' and '-inf' as such."""
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "-inf" if x < 0 else "inf"
    if abs(x) >= 1e6:
        return f"{x:.4g}"
    if x == round(x):
        return str(int(round(x)))
    if abs(x) < 5e-4:
        return f"{x:.3g}"
    return f"{x:.3f}"


def eq(x) -> str:
    """'=' when :func:`num` writes x exactly, '≈' when it rounds."""
    x = float(x)
    return "=" if (not math.isfinite(x) or float(num(x)) == x) else "≈"


def paren(x) -> str:
    """:func:`num`, in parentheses when negative (for products: 1·(-2))."""
    s = num(x)
    return f"({s})" if s.startswith("-") else s


def vec(x, digits=None, most=6) -> str:
    """(a, b, …) with at most ``most`` entries shown; ``digits`` fixes the decimals."""
    vals = [float(a) for a in np.ravel(x)]
    if len(vals) > most:
        return vec(vals[:most - 2], digits)[:-1] + ", …, " + vec(vals[-1:], digits)[1:]
    if digits is None:
        return "(" + ", ".join(num(a) for a in vals) + ")"
    return "(" + ", ".join(f"{a:.{digits}f}" if math.isfinite(a) and abs(a) < 1e6 else num(a)
                           for a in vals) + ")"


def wrap(parts, width, indent=0, sep=" ", first="") -> list[str]:
    """Join ``parts`` with ``sep`` into lines of at most ``width`` columns, breaking
    between parts (and inside a part only at spaces when it alone is too long).

    >>> wrap(["one two", "three"], 9, sep=", ")
    ['one two', 'three']
    """
    lines, cur = [], " " * indent + first
    base = len(cur)
    for p in parts:
        words = [p] if len(p) + indent <= width else re.split(r" (?![^()]*\))", p)
        for i, wd in enumerate(words):
            glue = (sep if i == 0 else " ") if len(cur) > base else ""
            if len(cur) + len(glue) + len(wd) > width and len(cur) > base:
                lines.append(cur.rstrip())
                cur, glue = " " * (indent + len(first) if first else indent), ""
                base = len(cur)
            cur += glue + wd
    if len(cur) > base or not lines:
        lines.append(cur.rstrip())
    return lines


def cell(x) -> str:
    """One matrix cell: 3 decimals, an exponent past 1e5, nan / inf / -inf as such."""
    if isinstance(x, str):
        return x
    x = float(x)
    if not math.isfinite(x):
        return num(x)
    return f"{x:.2e}" if abs(x) >= 1e5 else f"{x:.3f}"


def matrix(name, a, row_labels, col_labels, width, max_rows=12) -> list[str]:
    """A labelled matrix in at most ``width`` columns; middle rows and columns are
    elided with ⋮ / … when it does not fit.

    >>> print("\\n".join(matrix("w", [[0.5, 0.25]], ["q0"], ["k0", "k1"], 80)))
      w      k0     k1
      q0  0.500  0.250
    """
    a = np.asarray(a)
    cells = [[cell(x) for x in row] for row in a]
    rl = [str(x)[:12] for x in row_labels]
    cl = [str(x)[:10] for x in col_labels]
    cw = max([len(c) for c in cl] + [len(c) for row in cells for c in row] + [4])
    lw = max([len(x) for x in rl] + [len(name)]) + 2
    ncol = a.shape[1]
    fit = max(2, (width - lw) // (cw + 2))
    cols = list(range(ncol)) if ncol <= fit else list(range(fit - 2)) + [None, ncol - 1]
    rows = list(range(a.shape[0])) if a.shape[0] <= max_rows else \
        list(range(max_rows - 3)) + [None] + list(range(a.shape[0] - 2, a.shape[0]))

    def line(label, items):
        return (f"  {label:<{lw - 2}}" + "".join(f"  {x:>{cw}}" for x in items)).rstrip()

    out = [line(name, [("…" if j is None else cl[j]) for j in cols])]
    for i in rows:
        if i is None:
            out.append(line("⋮", []))
            continue
        out.append(line(rl[i], [("…" if j is None else cells[i][j]) for j in cols]))
    return out


def jsonable(x):
    """Nested lists for strict JSON: -inf as null, NaN as "nan", +inf as "inf";
    booleans and integers stay booleans and integers.

    >>> jsonable(np.array([1.5, -np.inf, np.nan, np.inf]))
    [1.5, None, 'nan', 'inf']
    """
    x = np.asarray(x)
    if x.dtype == bool or x.dtype.kind in "iu":          # booleans and integers (lengths) as they are
        return x.tolist()
    return _special(x.astype(np.float64).tolist())


def _special(x):
    if isinstance(x, list):
        return [_special(y) for y in x]
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else (None if x < 0 else "inf")


def what_nonfinite(x) -> str:
    """'NaN', 'inf' or 'NaN and inf': what the non-finite entries of x are."""
    x = np.asarray(x, dtype=np.float64)
    kinds = [k for k, m in (("NaN", np.isnan(x)), ("inf", np.isinf(x))) if m.any()]
    return " and ".join(kinds)
