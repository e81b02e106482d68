"""The package's shape: no source file over 600 lines, numba's compiled kernels cached
between processes, the version in one place."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import attnkit

SRC = Path(attnkit.__file__).parent


def test_no_source_file_over_600_lines():
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long


def test_version_in_one_place():
    from importlib.metadata import version
    assert attnkit.__version__ == version("attnkit")
    r = subprocess.run([sys.executable, "-m", "attnkit", "--version"], capture_output=True, text=True)
    assert r.stdout.strip() == f"attnkit {attnkit.__version__}"


def test_numba_kernels_are_cached_between_processes(tmp_path):
    pytest.importorskip("numba")
    code = ("import numpy as np; from attnkit.flash import numba_kernels as nk; "
            "s = np.zeros((4, 8), np.float32); m = np.full(4, -np.inf, np.float32); l = np.zeros(4, np.float32); "
            "nk.KERNELS.softmax_tile(s, m, l); "
            "print(sum(len(f.stats.cache_hits) for f in (nk._softmax_tile,)), "
            "sum(len(f.stats.cache_misses) for f in (nk._softmax_tile,)))")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    hits1, misses1 = map(int, first.stdout.split())
    hits2, misses2 = map(int, second.stdout.split())
    assert misses1 >= 1 and hits2 >= 1 and misses2 == 0, (first.stdout, second.stdout)
    assert any(tmp_path.rglob("*.nbi"))
