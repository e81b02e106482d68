"""`attnkit bench`: the check comes first and can fail, the timing covers every
provider and pass, FLOPs use the one formula, and the command line's errors are one
line. Speed itself is never asserted."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from attnkit import bench
from attnkit.cli import main
from attnkit.spec import flops

SMALL = dict(B=1, H=2, L=40, S=57, D=16, repeats=2, gap_s=0, quiet=True)


def test_checks_then_times_both_passes_against_torch():
    pytest.importorskip("torch")
    r = bench.run(causal=True, backward=True, **SMALL)
    assert r["checks"]["attnkit"]["ok"] and r["checks"]["torch"]["ok"]
    assert set(r["times"]) == {"fwd", "fwd+bwd"}
    for p in ("fwd", "fwd+bwd"):
        assert set(r["times"][p]) == {"attnkit", "torch"}
        assert all(t > 0 for t in r["times"][p].values())
    f = flops(1, 2, 40, 57, 16, causal=True)
    assert r["flops"]["fwd"] == f
    assert r["flops"]["fwd+bwd"] == f + flops(1, 2, 40, 57, 16, causal=True, backward=True)
    text = bench.report(r)
    assert "attnkit ÷ torch" in text and "GFLOP/s" in text and "causal" in text


@pytest.mark.parametrize("dtype", ["float64", "float16", "bfloat16"])
def test_other_dtypes_pass_their_check(dtype):
    if dtype == "bfloat16":
        pytest.importorskip("torch")
    r = bench.run(dtype=dtype, backward=True, peers=False, **SMALL)
    assert r["checks"]["attnkit"]["ok"], r["checks"]
    assert set(r["times"]["fwd+bwd"]) == {"attnkit"}


@pytest.mark.parametrize("causal", [False, True])
def test_half_precision_backward_check_counts_the_stored_output(causal):
    """Every provider's backward reads its output as stored (bfloat16): the budget's
    reference does too. Before it did, attnkit's correct gradients (and torch's on the
    GPU) failed at D=128 by 1.12x, and `attnkit bench --backward` refused to time."""
    pytest.importorskip("torch")
    provs, makers = bench._providers("bfloat16", "cpu", causal, True, "auto", False)
    checks = bench._check(provs, makers, "bfloat16", causal, True, 16, 128, 97, 113)
    assert checks["attnkit"]["ok"], checks


def test_a_wrong_result_fails_the_check_and_is_not_timed(monkeypatch):
    real = bench.api.attention

    def off(q, k, v, **kw):                    # every rung but the reference: a scale 10% too large
        if kw.get("backend") != "reference":
            kw["scale"] = 1.1 / np.sqrt(q.shape[-1])
        return real(q, k, v, **kw)

    monkeypatch.setattr(bench.api, "attention", off)
    r = bench.run(peers=False, **SMALL)
    assert not r["checks"]["attnkit"]["ok"] and r["checks"]["attnkit"]["worst"] > 1
    assert r["times"] == {}


def test_interleaved_shuffles_rounds_and_warms_up_what_it_is_told():
    calls = []
    runs = {key: (lambda key=key: calls.append(key)) for key in "abcd"}
    times = bench.interleaved(runs, 6, gap_s=0, warmup=["a"])
    assert calls[0] == "a" and calls.count("a") == 7 and calls.count("b") == 6
    assert all(len(t) == 6 for t in times.values())
    rounds = ["".join(calls[1 + 4 * i: 5 + 4 * i]) for i in range(6)]
    assert all(sorted(r) == list("abcd") for r in rounds) and len(set(rounds)) > 1


def test_settle_times_the_second_of_two_back_to_back_calls():
    calls, clock = [], iter(range(100))

    def fn():
        calls.append(next(clock))
        if len(calls) % 2:                               # the untimed call of each round is slow
            time.sleep(0.5)

    times = bench.interleaved({"f": fn}, 3, gap_s=0, warmup=[], settle=True)
    assert len(calls) == 6 and len(times["f"]) == 3 and max(times["f"]) < 0.25


def test_prepare_runs_untimed_before_each_run_of_its_key():
    calls = []

    def switch():
        calls.append("switch")
        time.sleep(0.5)                                  # slow, and not timed

    runs = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    times = bench.interleaved(runs, 4, gap_s=0, prepare={"a": switch})
    assert calls.count("switch") == 5 and all(calls[i + 1] == "a" for i, c in enumerate(calls) if c == "switch")
    assert all(calls[i - 1] == "switch" for i, c in enumerate(calls) if c == "a")
    assert max(times["a"]) < 0.25
    calls.clear()                                        # with settle: switch, the untimed run, the timed one
    bench.interleaved(runs, 2, gap_s=0, warmup=[], settle=True, prepare={"a": switch})
    assert "".join(c[0] for c in calls).replace("bb", "") == "saa" * 2
    with pytest.raises(ValueError, match=r"^prepare: \['c'\] are not among the runs \['a', 'b'\]$"):
        bench.interleaved(runs, 1, gap_s=0, prepare={"c": switch})


def test_command_line_json_and_errors(capsys):
    rc = main(["bench", "--shape", "1", "2", "32", "8", "--repeats", "1", "--no-peers", "--json"])
    out, _ = capsys.readouterr()
    assert rc == 0
    r = json.loads(out)
    assert r["setup"]["L"] == 32 and r["checks"]["attnkit"]["ok"] and "attnkit" in r["times"]["fwd"]
    rc = main(["bench", "--shape", "1", "0", "32", "8"])
    _, err = capsys.readouterr()
    assert rc == 1 and err.count("\n") == 1 and "H: expected a positive integer, got 0" in err


def test_hf_calls_counts_a_models_attention_calls_and_restores_attnkits_function():
    """One forward of a 3-layer model switched to "attnkit": 3 calls, the same logits
    as without counting; afterwards the registered function is attnkit's own again."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import attnkit.hf
    attnkit.hf.register()
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="attnkit").eval()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = []
        assert bench.hf_calls(lambda: got.append(model(input_ids=ids).logits)) == 3
    assert torch.equal(got[0], want)
    assert transformers.AttentionInterface._global_mapping["attnkit"] is attnkit.hf.attention_forward
