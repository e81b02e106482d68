"""Matrices for the command line: text like "1,0;0,1" and files (``@q.npy``), checked
as `attnkit explain` takes them (errors name the option the user typed)."""

from __future__ import annotations

import os
import pickle
import re
import zipfile

import numpy as np

# the largest array explain reads from a file (.npy and .npz by their arrays' sizes, .pt
# by the file's; text files a 16th of it, as parsing takes ~8 times a file's size): a
# model's layer at a few thousand tokens is tens of MB, and one head of it is what a
# trace shows
MAX_FILE_BYTES = 1 << 30
TRUE = {"1", "t", "true", "x", "y", "yes"}
FALSE = {"0", "f", "false", ".", "n", "no"}


def parse_matrix(text, name, kind=float, source=None):
    """A 2-D array from text like "1,0;0,1" (rows by ";", values by "," or spaces).
    ``kind`` is float (finite values; "-inf" allowed for --bias) or bool. Errors name
    ``name`` and the text (or ``source``, e.g. the file it came from).

    >>> parse_matrix("1,0;0,1", "--q").tolist()
    [[1.0, 0.0], [0.0, 1.0]]
    >>> parse_matrix("1,0;1", "--q")
    Traceback (most recent call last):
    ...
    ValueError: --q: row 2 has 1 value but row 1 has 2 in '1,0;1'
    >>> parse_matrix("0 1; x .", "--drop", bool).tolist()
    [[False, True], [True, False]]
    """
    where = source or repr(text)
    rows = [r.strip() for r in text.strip().strip(";").split(";")]
    cells = [[c for c in re.split(r"[,\s]+", r) if c] for r in rows]
    if not cells or not all(cells):
        raise ValueError(f"{name}: expected rows of numbers like '1,0;0,1', got {where}")
    for i, r in enumerate(cells[1:], start=2):
        if len(r) != len(cells[0]):
            n = len(r)
            raise ValueError(f"{name}: row {i} has {n} value{'s' if n != 1 else ''} but row 1 "
                             f"has {len(cells[0])} in {where}")
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
        raise ValueError(f"{name}: {bad!r} is not a number (in {where})") from None
    return _finite(a, name, where)


def _finite(a, name, where):
    """a (float64), its values checked: finite, or −inf for --bias (a term that
    excludes the key) and --sinks (no sink)."""
    inf_ok = name in ("--bias", "--sinks")                    # (a sink of −inf: no sink)
    ok = np.isfinite(a) | (np.isneginf(a) if inf_ok else False)
    if not ok.all():
        raise ValueError(f"{name}: values must be finite{' (or -inf)' if inf_ok else ''}, got "
                         f"{int((~ok).sum())} that {'is' if (~ok).sum() == 1 else 'are'} not in {where}")
    return a


# files a matrix option reads (@PATH): NumPy's own formats, text, and torch's
TEXT_FILES = (".csv", ".tsv", ".txt")


def read_matrix(text, name, kind=float, vector=False):
    """The array of a matrix option: text like "1,0;0,1" (:func:`parse_matrix`) or
    ``@PATH``, a file: ``.npy``, ``.npz`` (``@PATH:NAME`` for one of several arrays),
    ``.pt`` (a torch tensor, torch installed), or text (``.csv``, ``.tsv``, ``.txt``:
    rows of values separated by commas, tabs or spaces; blank and ``#`` lines
    skipped). Files keep their shape, heads and batch included ((…, H, L, D)), but a
    1-D array is one row (1, n), or with ``vector`` stays 1-D (and a 0-d one is
    taken); values are checked as :func:`parse_matrix` checks them. Arrays over
    MAX_FILE_BYTES (1 GiB; text files over 64 MiB) are refused before they are read.

    >>> import numpy as np, os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "q.npy"); np.save(path, np.eye(2))
    >>> read_matrix("@" + path, "--q").tolist()
    [[1.0, 0.0], [0.0, 1.0]]
    """
    if not text.startswith("@"):
        return parse_matrix(text, name, kind)
    path, member = text[1:], None
    if not os.path.isfile(path) and ".npz:" in path:
        path, member = path.rsplit(":", 1)
    if not path:
        raise ValueError(f"{name}: expected a file name after '@', got {text!r}")
    if os.path.isdir(path):
        raise ValueError(f"{name}: {path!r} is a folder, not a file")
    if not os.path.isfile(path):
        raise ValueError(f"{name}: no file {path!r}")
    a = _load(path, name, member, kind)
    if not isinstance(a, np.ndarray) or a.dtype.kind not in "biuf" or a.ndim == 0 and not vector or a.size == 0:
        what = ("not a tensor" if not isinstance(a, np.ndarray) else
                f"{'an empty' if a.size == 0 else 'a'} {a.dtype} array of shape {a.shape}")
        raise ValueError(f"{name}: expected an array of numbers in {path}, got {what}")
    if kind is bool:
        if not np.isin(a, (0, 1)).all():
            raise ValueError(f"{name}: a mask holds 1/0 (or True/False); {path} holds other values")
        return a.astype(bool)
    a = _finite(a.astype(np.float64), name, path)
    return a.reshape(1, -1) if a.ndim == 1 and not vector else a


def _load(path, name, member, kind):
    """What file ``path`` holds (see :func:`read_matrix`): an array, or anything else
    for the caller to refuse; errors name the option."""
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext == ".pt":
            _check_bytes(os.path.getsize(path), name, path)
            import torch
            t = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(t, torch.Tensor) or t.is_complex():
                return t if not isinstance(t, torch.Tensor) else t.resolve_conj().numpy()
            return t.detach().to_dense().double().numpy()       # (every float exactly, bfloat16 too)
        if ext in (".npy", ".npz"):
            # (the contents decide, not the name; a .npy is mapped: its size read from its header)
            data = np.load(path, allow_pickle=False, mmap_mode="r")
            if isinstance(data, np.ndarray):
                _check_bytes(data.nbytes, name, path)
                return np.array(data)
            with data:
                names = list(data.files)
                if not names:
                    raise ValueError(f"{name}: {path} holds no arrays")
                if member is None and len(names) != 1:
                    raise ValueError(f"{name}: {path} holds {len(names)} arrays {names}; pick one: @{path}:NAME")
                if (member or names[0]) not in names:
                    raise ValueError(f"{name}: {path} has no array {member!r} (it holds {names})")
                key = member or names[0]                    # (its file in the zip: NAME.npy or NAME,
                files = data.zip.namelist()                 # unpacked: either may be read)
                _check_bytes(max(data.zip.getinfo(n).file_size for n in (key, key + ".npy") if n in files), name,
                             f"{path}:{key}")
                return data[key]
        if ext in TEXT_FILES:
            _check_bytes(os.path.getsize(path), name, path, MAX_FILE_BYTES // 16)
            with open(path, encoding="utf-8-sig") as f:
                rows = [r for r in f.read().splitlines() if r.strip() and not r.lstrip().startswith("#")]
            return parse_matrix(";".join(rows), name, kind, source=path)
    except ImportError:
        raise ValueError(f"{name}: reading {path} (a .pt file) needs torch") from None
    except ValueError as e:
        if str(e).startswith(name):
            raise
        raise ValueError(f"{name}: cannot read {path}: {' '.join(str(e).split())[:200]}") from None
    except (OSError, EOFError, RuntimeError, TypeError, UnicodeDecodeError, pickle.UnpicklingError,
            zipfile.BadZipFile) as e:
        raise ValueError(f"{name}: cannot read {path}: {' '.join(str(e).split())[:200]}") from None
    raise ValueError(f"{name}: cannot read {path!r}: expected .npy, .npz, .pt, .csv, .tsv or .txt")


def _check_bytes(n, name, what, limit=None):
    """Refuse an array (or file) of n bytes over ``limit`` (MAX_FILE_BYTES), before it is read."""
    limit = MAX_FILE_BYTES if limit is None else limit

    def size(n):
        return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n:,} bytes"
    if n > limit:
        raise ValueError(f"{name}: {what} holds {size(n)}, over the {size(limit)} explain reads; "
                         "save the heads you want to see (e.g. np.save('q0.npy', q[0, :2]))")


def _is_float(c):
    try:
        float(c)
    except ValueError:
        return False
    return True
