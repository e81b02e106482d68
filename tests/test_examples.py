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
    assert 0.0 <= acc <= 1.0
