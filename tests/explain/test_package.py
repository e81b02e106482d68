"""attnkit.explain, the package: the name attnkit.explain is the function, the
module is importable by name, and importing it needs neither matplotlib nor torch."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import attnkit

SRC = Path(attnkit.__file__).parent


def test_the_attribute_is_the_function_and_the_module_is_the_package():
    mod = importlib.import_module("attnkit.explain")
    assert callable(attnkit.explain) and attnkit.explain is mod.explain
    assert sys.modules["attnkit.explain"] is mod and hasattr(mod, "__path__")
    for name in mod.__all__:
        assert getattr(mod, name) is not None, name
    from attnkit.explain import EXAMPLE, STEP_TITLES, Trace, mistakes, worked_example  # noqa: F401


def test_no_source_file_over_600_lines():
    files = list((SRC / "explain").glob("*.py")) + [SRC / n for n in ("plot.py", "cli.py", "__main__.py")]
    assert len(files) >= 8
    for f in files:
        assert len(f.read_text(encoding="utf-8").splitlines()) <= 600, f


def test_importing_and_explaining_never_imports_matplotlib_or_torch():
    code = ("import sys, attnkit, attnkit.explain, attnkit.plot, attnkit.cli\n"
            "assert attnkit.cli.main(['explain']) == 0\n"
            "assert attnkit.cli.main(['explain', '--random', '3', '4', '2', '--json']) == 0\n"
            "assert attnkit.cli.main(['explain', '--packed', '2,3', '--sinks', '1', '--alibi', '0.5', "
            "'--dropout', '0.2']) == 0\n"
            "print('matplotlib' in sys.modules, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "False False"
