"""Dropout seeds in [0, 2⁶⁴) crossing the torch ops as int64 (found by mutation testing
of torch/op.py and philox.int64): every seed comes back whole, and a compiled decoding
call drops what the NumPy call with the same seed drops."""

import pytest

torch = pytest.importorskip("torch")

import attnkit  # noqa: E402
from attnkit import philox  # noqa: E402
from attnkit.spec import validate  # noqa: E402
from attnkit.testing import max_error  # noqa: E402
from attnkit.torch import op  # noqa: E402

EDGES = [0, 1, 2 ** 62 - 1, 2 ** 62, 2 ** 62 + 3, 2 ** 63 - 1, 2 ** 63, 2 ** 63 + 5, 2 ** 64 - 1]


def test_the_op_arguments_carry_every_seed_whole():
    """The seed travels as one int64 tensor (its 64 bits) and from_op_args gives back
    the very seed: a wrong wrap (at 2⁶² instead of 2⁶³: int64 overflow; modulo 2⁶⁵:
    seed + 2⁶⁴, outside the contract's [0, 2⁶⁴)) is caught at the boundaries."""
    q, k, v = (torch.zeros(1, 2, 3, 4, dtype=torch.float64) for _ in range(3))
    for seed in EDGES:
        w = philox.int64(seed)
        assert -2 ** 63 <= w < 2 ** 63 and w % 2 ** 64 == seed
        spec = validate(q, k, v, dropout=0.5, seed=seed)
        t = op.seed_tensor(spec)
        assert t.dtype == torch.int64 and t.dim() == 0 and int(t.item()) == w
        back, rung = op.from_op_args(op.to_op_args(spec, "flash"))
        assert rung == "flash" and back.seed == seed and type(back.seed) is int


@pytest.mark.parametrize("seed", [2 ** 62 + 3, 2 ** 63, 2 ** 64 - 1])
def test_a_compiled_decoding_call_with_a_large_seed_drops_what_numpy_drops(seed):
    """attention_kvcache under torch.compile hands the seed to its op as an int64 and
    back (x mod 2⁶⁴): for seeds ≥ 2⁶³ a wrong modulus gives a seed the eager call
    refuses. The compiled call equals the eager torch call bitwise and the NumPy
    reference with the same seed (to 1e-12 in float64); dropout did drop."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(seed % 1000)
    q = torch.randn(2, 4, 3, 8, generator=g, dtype=torch.float64)
    kc, vc = (torch.randn(2, 2, 10, 8, generator=g, dtype=torch.float64) for _ in range(2))
    n = torch.tensor([6, 9])

    def step(q, kc, vc, n):
        return attnkit.attention_kvcache(q, kc, vc, n, causal=True, dropout=0.4, seed=seed)

    got = torch.compile(step, fullgraph=True, backend="eager")(q, kc, vc, n)
    assert torch.equal(got, step(q, kc, vc, n))
    arrays = (x.numpy() for x in (q, kc, vc, n))
    want = attnkit.attention_kvcache(*arrays, causal=True, dropout=0.4, seed=seed, backend="reference")
    assert max_error(got.numpy(), want) <= 1e-12
    plain = attnkit.attention_kvcache(q, kc, vc, n, causal=True)
    assert max_error(got.numpy(), plain.numpy()) > 1e-3                  # some weights were dropped
