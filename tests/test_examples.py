"""The examples run (short versions) and do what they say."""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_train_tiny_transformer_loss_falls(capsys):
    losses, acc = load("train_tiny_transformer").main(["--quick"])
    text = capsys.readouterr().out
    assert "loss" in text and "final accuracy" in text
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < first - 0.4, (first, last)        # chance level is ln(10) ≈ 2.30
    assert acc > 0.2                                   # chance is 0.1 (ten symbols)


def test_ring_attention_example_equals_single_process():
    """examples/ring_attention.py on 2 spawned gloo processes, short sequence."""
    import subprocess
    import sys
    res = subprocess.run([sys.executable, str(EXAMPLES / "ring_attention.py"), "--world", "2", "--length", "256"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "OK: equal to single-process attnkit.attention" in res.stdout


def test_generate_with_a_paged_cache_matches_one_full_pass(capsys):
    worst = load("generate").main()
    assert worst < 1e-10 and "largest difference" in capsys.readouterr().out
