"""Matrices for the command line: text like "1,0;0,1" and files (``@q.npy``), checked
as `attnkit explain` takes them (errors name the option the user typed)."""

from __future__ import annotations

import os
import pickle
import re

import numpy as np

TRUE = {"1", "t", "true", "x", "y", "yes"}
FALSE = {"0", "f", "false", ".", "n", "no"}


def parse_matrix(text, name, kind=float):
    """A 2-D array from text like "1,0;0,1" (rows by ";", values by "," or spaces).
    ``kind`` is float (finite values; "-inf" allowed for --bias) or bool.

    >>> parse_matrix("1,0;0,1", "--q").tolist()
    [[1.0, 0.0], [0.0, 1.0]]
    >>> parse_matrix("1,0;1", "--q")
    Traceback (most recent call last):
    ...
    ValueError: --q: row 2 has 1 value but row 1 has 2 in '1,0;1'
    >>> parse_matrix("0 1; x .", "--drop", bool).tolist()
    [[False, True], [True, False]]
    """
    rows = [r.strip() for r in text.strip().strip(";").split(";")]
    cells = [[c for c in re.split(r"[,\s]+", r) if c] for r in rows]
    if not cells or not all(cells):
        raise ValueError(f"{name}: expected rows of numbers like '1,0;0,1', got {text!r}")
    for i, r in enumerate(cells[1:], start=2):
        if len(r) != len(cells[0]):
            n = len(r)
            raise ValueError(f"{name}: row {i} has {n} value{'s' if n != 1 else ''} but row 1 "
                             f"has {len(cells[0])} in {text!r}")
    if kind is bool:
        out = []
        for r in cells:
            for c in r:
                if c.lower() not in TRUE | FALSE:
                    raise ValueError(f"{name}: {c!r} is not a mask value (use 1/0, t/f or x/.)")
            out.append([c.lower() in TRUE for c in r])
        return np.array(out, dtype=bool)
    try:
        a = np.array([[float(c) for c in r] for r in cells], dtype=np.float64)
    except ValueError:
        bad = next(c for r in cells for c in r if not _is_float(c))
        raise ValueError(f"{name}: {bad!r} is not a number (in {text!r})") from None
    ok = np.isfinite(a) | (np.isneginf(a) if name == "--bias" else False)
    if not ok.all():
        raise ValueError(f"{name}: values must be finite, got {text!r}")
    return a


# files a matrix option reads (@PATH): NumPy's own formats, text, and torch's
_TEXT_FILES = (".csv", ".tsv", ".txt")


def read_matrix(text, name, kind=float):
    """The array of a matrix option: text like "1,0;0,1" (:func:`parse_matrix`) or
    ``@PATH``, a file: ``.npy``, ``.npz`` (``@PATH:NAME`` for one of several arrays),
    ``.pt`` (a torch tensor, torch installed), or text (``.csv``, ``.tsv``, ``.txt``:
    rows of values separated by commas, tabs or spaces). Files keep their shape, heads
    and batch included ((…, H, L, D)); values are checked as :func:`parse_matrix`
    checks them.

    >>> import numpy as np, os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "q.npy"); np.save(path, np.eye(2))
    >>> read_matrix("@" + path, "--q").tolist()
    [[1.0, 0.0], [0.0, 1.0]]
    """
    if not text.startswith("@"):
        return parse_matrix(text, name, kind)
    path, member = text[1:], None
    if ".npz:" in path:
        path, member = path.rsplit(":", 1)
    if not path:
        raise ValueError(f"{name}: expected a file name after '@', got {text!r}")
    if not os.path.isfile(path):
        raise ValueError(f"{name}: no file {path!r}")
    a = _load(path, name, member, kind)
    if a is None or not isinstance(a, np.ndarray) or a.dtype.kind not in "biuf" or a.ndim == 0:
        what = "not a tensor" if a is None else f"a {a.dtype} array of shape {a.shape}"
        raise ValueError(f"{name}: expected an array of numbers in {path}, got {what}")
    if kind is bool:
        if not np.isin(a, (0, 1)).all():
            raise ValueError(f"{name}: a mask holds 1/0 (or True/False); {path} holds other values")
        return a.astype(bool)
    a = a.astype(np.float64)
    ok = np.isfinite(a) | (np.isneginf(a) if name == "--bias" else False)
    if not ok.all():
        raise ValueError(f"{name}: values must be finite, got {int((~ok).sum())} that are not in {path}")
    return a.reshape(1, -1) if a.ndim == 1 else a


def _load(path, name, member, kind):
    """The array in file ``path`` (see :func:`read_matrix`); errors name the option."""
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext == ".pt":
            import torch
            a = torch.load(path, map_location="cpu", weights_only=True)
            return a.detach().float().numpy() if isinstance(a, torch.Tensor) else None
        if ext == ".npy":
            return np.load(path, allow_pickle=False)
        if ext == ".npz":
            with np.load(path, allow_pickle=False) as z:
                names = list(z.files)
                if member is None and len(names) != 1:
                    raise ValueError(f"{name}: {path} holds {len(names)} arrays {names}; pick one: @{path}:NAME")
                if (member or names[0]) not in names:
                    raise ValueError(f"{name}: {path} has no array {member!r} (it holds {names})")
                return z[member or names[0]]
        if ext in _TEXT_FILES:
            with open(path, encoding="utf-8") as f:
                rows = [r for r in f.read().splitlines() if r.strip() and not r.lstrip().startswith("#")]
            return parse_matrix(";".join(rows), f"{name} ({path})", kind)
    except ImportError:
        raise ValueError(f"{name}: reading {path} (a .pt file) needs torch") from None
    except ValueError as e:
        if str(e).startswith(name):
            raise ValueError(str(e)[:300]) from None
        raise ValueError(f"{name}: cannot read {path}: {' '.join(str(e).split())[:200]}") from None
    except (OSError, EOFError, RuntimeError, UnicodeDecodeError, pickle.UnpicklingError) as e:
        raise ValueError(f"{name}: cannot read {path}: {' '.join(str(e).split())[:200]}") from None
    raise ValueError(f"{name}: cannot read {path!r}: expected .npy, .npz, .pt, .csv, .tsv or .txt")


def _is_float(c):
    try:
        float(c)
    except ValueError:
        return False
    return True
