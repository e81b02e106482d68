"""`attnkit explain` on inputs read from files (``--q @q.npy``): NumPy's formats,
text and torch's, arrays with heads and a batch (--head, --batch, GQA groups), masks
from files, and one-line errors for files it cannot take."""

from __future__ import annotations

import json

import numpy as np
import pytest

import attnkit
from attnkit.testing import max_error

from test_cli import run

B, H, HKV, L, S, D = 2, 8, 2, 3, 5, 4


@pytest.fixture
def files(tmp_path, monkeypatch):
    """q (B, H, L, D), k and v (B, Hkv, S, D) as .npy files in the working folder."""
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    arrays = {n: rng.standard_normal(shape) for n, shape in (("q", (B, H, L, D)), ("k", (B, HKV, S, D)),
                                                             ("v", (B, HKV, S, D)))}
    for n, a in arrays.items():
        np.save(f"{n}.npy", a)
    return arrays


def explained(capsys, *argv):
    """(inputs, steps) of `attnkit explain --json` with argv."""
    rc, out, err = run(capsys, "explain", "--json", *argv)
    assert rc == 0, err
    d = json.loads(out)
    return {n: np.array(d["inputs"][n]) for n in "qkv"}, {n: np.array(d["steps"][n]) for n in ("out", "weights")}


@pytest.mark.parametrize("head", [1, 5])
def test_a_head_of_a_batch_element_is_its_own_attention(capsys, files, head):
    """--batch 1 --head h: query head h and the key/value head of its group (h // 4),
    the numbers attnkit.attention gives for that slice."""
    q, k, v = (files[n] for n in "qkv")
    inputs, steps = explained(capsys, "--q", "@q.npy", "--k", "@k.npy", "--v", "@v.npy", "--head", str(head),
                              "--batch", "1", "--causal")
    g = head // (H // HKV)
    assert np.array_equal(inputs["q"], q[1, head]) and np.array_equal(inputs["k"], k[1, g])
    out, w = attnkit.attention(q[1, head], k[1, g], v[1, g], causal=True, return_weights=True)
    assert max_error(steps["out"], out) <= 1e-12 and max_error(steps["weights"], w) <= 1e-12


def test_every_head_without_head(capsys, files):
    """--batch alone: every head of that element, GQA as attnkit.attention reads it;
    no pick: every block of the whole arrays; a per-head sink typed once."""
    q, k, v = (files[n] for n in "qkv")
    inputs, steps = explained(capsys, "--q", "@q.npy", "--k", "@k.npy", "--v", "@v.npy", "--batch", "0",
                              "--sinks", "0.5")
    assert inputs["q"].shape == (H, L, D)
    assert max_error(steps["out"], attnkit.attention(q[0], k[0], v[0], sinks=np.array(0.5))) <= 1e-12
    inputs, steps = explained(capsys, "--q", "@q.npy", "--k", "@k.npy", "--v", "@v.npy", "--causal")
    assert inputs["q"].shape == (B, H, L, D)
    assert max_error(steps["out"], attnkit.attention(q, k, v, causal=True)) <= 1e-12


def test_the_text_says_what_was_read_and_picked(capsys, files):
    rc, out, err = run(capsys, "explain", "--q", "@q.npy", "--k", "@k.npy", "--v", "@v.npy", "--head", "5",
                       "--batch", "1")
    assert rc == 0, err
    said = " ".join(out.split())
    assert said.startswith("Read q (2, 8, 3, 4) from q.npy, k (2, 2, 5, 4) from k.npy")
    assert "batch element 1, query head 5 (its group's key and value head 1)." in said


def test_other_formats_give_the_same_numbers(capsys, files, tmp_path):
    """.npz (one array, or NAME of several), .pt (float64 read exactly), .csv (with a
    byte-order mark) and .txt (comments and blank lines skipped) read the same values
    as .npy; the contents decide the format, not the name."""
    torch = pytest.importorskip("torch")
    q, k, v = files["q"][0, 0], files["k"][0, 0], files["v"][0, 0]
    np.savez("q.npz", q=q)
    np.savez("kv.npz", k=k, v=v)
    torch.save(torch.from_numpy(q), "q.pt")
    (tmp_path / "k.csv").write_text("\ufeff" + "\n".join(",".join(repr(float(x)) for x in row) for row in k),
                                    encoding="utf-8")
    (tmp_path / "v.txt").write_text("# values\n\n" + "\n".join(" ".join(repr(float(x)) for x in row) for row in v) + "\n")
    np.save("v_npz_named.npy", v)
    (tmp_path / "v_npz_named.npy").rename(tmp_path / "v.npz")     # .npy contents under a .npz name
    (tmp_path / "q.npz").rename(tmp_path / "q_archive.npy")        # and the other way round
    want = attnkit.attention(q, k, v)
    for args in (["@q_archive.npy", "@kv.npz:k", "@kv.npz:v"], ["@q.pt", "@k.csv", "@v.txt"],
                 ["@q.pt", "@k.csv", "@v.npz"]):
        inputs, steps = explained(capsys, "--q", args[0], "--k", args[1], "--v", args[2])
        assert np.array_equal(inputs["q"], q) and np.array_equal(inputs["k"], k) and np.array_equal(inputs["v"], v)
        assert max_error(steps["out"], want) <= 1e-12


def test_masks_shared_by_the_batch_or_the_heads_and_minus_inf_from_text(capsys, files, tmp_path):
    """A bias (H, L, S) (no batch axis: shared) and a keep mask (1, L, S) with --batch;
    −inf in a text file's bias excludes a key, as typed."""
    q, k, v = (files[n] for n in "qkv")
    bias = np.random.default_rng(2).standard_normal((H, L, S))
    np.save("bias.npy", bias)
    keep = np.ones((1, L, S), dtype=bool)
    keep[0, :, 1] = False
    np.save("keep.npy", keep)
    _, steps = explained(capsys, "--q", "@q.npy", "--k", "@k.npy", "--v", "@v.npy", "--batch", "1",
                         "--bias", "@bias.npy", "--keep", "@keep.npy")
    assert max_error(steps["out"], attnkit.attention(q[1], k[1], v[1], bias=bias, keep=keep)) <= 1e-12
    (tmp_path / "b.csv").write_text("\n".join(",".join("-inf" if j == 2 else "0" for j in range(S)) for _ in range(L)))
    _, steps = explained(capsys, "--q", "@q.npy", "--k", "@k.npy", "--v", "@v.npy", "--batch", "0", "--head", "3",
                         "--bias", "@b.csv")
    assert np.all(steps["weights"][:, 2] == 0)
    want = attnkit.attention(q[0, 3], k[0, 0], v[0, 0], drop=np.arange(S) == 2)
    assert max_error(steps["out"], want) <= 1e-12


def test_masks_and_bias_from_files_follow_head_and_batch(capsys, files):
    """A bias shared by the batch and the heads (1, 1, L, S) and a keep mask (B, H, L, S):
    the slices of --batch/--head."""
    q, k, v = (files[n] for n in "qkv")
    rng = np.random.default_rng(1)
    bias = rng.standard_normal((1, 1, L, S))
    keep = rng.random((B, H, L, S)) < 0.6
    keep[..., 0] = True
    np.save("bias.npy", bias)
    np.save("keep.npy", keep)
    _, steps = explained(capsys, "--q", "@q.npy", "--k", "@k.npy", "--v", "@v.npy", "--head", "6", "--batch", "1",
                         "--bias", "@bias.npy", "--keep", "@keep.npy")
    want = attnkit.attention(q[1, 6], k[1, 1], v[1, 1], bias=bias[0, 0], keep=keep[1, 6])
    assert max_error(steps["out"], want) <= 1e-12


@pytest.mark.parametrize("pick", [[], ["--batch", "1"], ["--batch", "1", "--head", "6"]], ids=["all", "batch", "head"])
def test_per_head_sinks_and_slopes_from_files_follow_head_and_batch(capsys, files, pick):
    """--sinks @FILE (H,) and --alibi @FILE (B, H), as captured from a model (gpt-oss's
    sinks, BLOOM's slopes): each head its own, the slices of --batch/--head."""
    q, k, v = (files[n] for n in "qkv")
    rng = np.random.default_rng(2)
    sinks, slopes = rng.standard_normal(H), rng.random((B, H))
    np.save("sinks.npy", sinks)
    np.save("slopes.npy", slopes)
    _, steps = explained(capsys, "--q", "@q.npy", "--k", "@k.npy", "--v", "@v.npy", "--causal", "--sinks",
                         "@sinks.npy", "--alibi", "@slopes.npy", *pick)
    b, h = (slice(None) if n not in pick else int(pick[pick.index(n) + 1]) for n in ("--batch", "--head"))
    g = h if isinstance(h, slice) else h // (H // HKV)
    want = attnkit.attention(q[b][..., h, :, :], k[b][..., g, :, :], v[b][..., g, :, :], causal=True,
                             sinks=np.asarray(sinks[h]), alibi_slopes=np.atleast_1d(slopes[b][..., h]))
    assert max_error(steps["out"], want) <= 1e-12


def test_sinks_from_text_files_per_query_or_per_head(capsys, files, tmp_path):
    """A text file is a table: one row of L values is one sink per query (as typed), a
    column of H values one per head (it broadcasts to (H, L))."""
    q, k, v = (files[n] for n in "qkv")
    (tmp_path / "row.csv").write_text("0.5,-1,2\n")
    (tmp_path / "col.csv").write_text("\n".join(str(x) for x in range(H)) + "\n")
    _, steps = explained(capsys, "--q", "@q.npy", "--k", "@k.npy", "--v", "@v.npy", "--batch", "0", "--head", "3",
                         "--sinks", "@row.csv")
    want = attnkit.attention(q[0, 3], k[0, 0], v[0, 0], sinks=np.array([[0.5, -1, 2]]))
    assert max_error(steps["out"], want) <= 1e-12
    _, steps = explained(capsys, "--q", "@q.npy", "--k", "@k.npy", "--v", "@v.npy", "--batch", "0", "--head", "3",
                         "--sinks", "@col.csv")
    assert max_error(steps["out"], attnkit.attention(q[0, 3], k[0, 0], v[0, 0], sinks=np.array(3.0))) <= 1e-12


def test_slopes_and_sinks_as_numpy_writes_them_to_text_a_scalar_and_no_sink(capsys, files, tmp_path):
    """np.savetxt of H slopes writes a column: one slope per head, as a row would be; a
    0-d file is one value for every head; a sink of −inf is no sink."""
    q, k, v = (files[n] for n in "qkv")
    slopes = np.random.default_rng(3).random(H)
    np.savetxt("slopes.txt", slopes)
    np.save("sink.npy", np.array(0.7))
    np.save("nosink.npy", np.full(H, -np.inf))
    _, steps = explained(capsys, "--q", "@q.npy", "--k", "@k.npy", "--v", "@v.npy", "--batch", "1", "--head", "2",
                         "--alibi", "@slopes.txt", "--sinks", "@sink.npy")
    want = attnkit.attention(q[1, 2], k[1, 0], v[1, 0], alibi_slopes=slopes[2:3], sinks=np.array(0.7))
    assert max_error(steps["out"], want) <= 1e-12
    _, steps = explained(capsys, "--q", "@q.npy", "--k", "@k.npy", "--v", "@v.npy", "--batch", "0",
                         "--sinks", "@nosink.npy")
    assert max_error(steps["out"], attnkit.attention(q[0], k[0], v[0])) <= 1e-12


def _bad_files(tmp_path):
    np.save("words.npy", np.array(["a", "b"]))
    np.save("empty.npy", np.zeros((0, 2)))
    np.save("bias2.npy", np.zeros((2, L, S)))                # 2 heads: not 1 or q's 8
    np.savez("none.npz")
    (tmp_path / "folder.npy").mkdir()
    np.save("nan.npy", np.array([[1.0, np.nan]]))
    np.save("twos.npy", np.array([[2, 0]]))
    np.save("five.npy", np.zeros((1, 1, 1, 1, 2)))
    np.savez("two.npz", a=np.ones((1, 2)), b=np.ones((1, 2)))
    (tmp_path / "q.json").write_text("[[1, 0]]")
    (tmp_path / "broken.npy").write_bytes(b"not numpy")
    (tmp_path / "brokenzip.npz").write_bytes(b"PK\x03\x04 not a zip")   # a zip's magic, then nothing
    np.save("three.npy", np.ones(3))
    np.save("q3.npy", np.ones((H, L, D)))
    np.save("sinks3.npy", np.zeros((3, H, L)))
    np.save("keep3.npy", np.ones((3, H, L, S), dtype=bool))


BAD_FILES = [
    (["--q", "@missing.npy", "--k", "1,0", "--v", "1,0"], "--q: no file 'missing.npy'"),
    (["--q", "@", "--k", "1,0", "--v", "1,0"], "--q: expected a file name after '@'"),
    (["--q", "@q.json", "--k", "1,0", "--v", "1,0"], "--q: cannot read 'q.json': expected .npy, .npz, .pt"),
    (["--q", "@broken.npy", "--k", "1,0", "--v", "1,0"], "--q: cannot read broken.npy"),
    (["--q", "@brokenzip.npz", "--k", "1,0", "--v", "1,0"], "--q: cannot read brokenzip.npz"),
    (["--q", "@words.npy", "--k", "1,0", "--v", "1,0"], "--q: expected an array of numbers in words.npy"),
    (["--q", "@nan.npy", "--k", "1,0", "--v", "1,0"], "--q: values must be finite"),
    (["--q", "1,0", "--k", "1,0", "--v", "1,0", "--keep", "@twos.npy"], "--keep: a mask holds 1/0"),
    (["--q", "@two.npz", "--k", "1,0", "--v", "1,0"], "--q: two.npz holds 2 arrays ['a', 'b']; pick one"),
    (["--q", "@two.npz:c", "--k", "1,0", "--v", "1,0"], "--q: two.npz has no array 'c'"),
    (["--q", "@q.npy", "--k", "@k.npy", "--v", "@v.npy", "--head", "1"],
     "--q: shape (2, 8, 3, 4) holds a batch of 2; pick one with --batch N"),
    (["--q", "@q.npy", "--k", "@k.npy", "--v", "@v.npy", "--batch", "0", "--head", "1", "--bias", "@bias2.npy"],
     "--bias: shape (2, 3, 5) has 2 heads; expected 1 or q's 8"),
    (["--q", "@q.npy", "--k", "@k.npy", "--v", "@v.npy", "--batch", "0", "--head", "1", "--sinks", "@three.npy"],
     "--sinks: shape (3,) has 3 heads; expected 1 or q's 8"),
    (["--q", "@q.npy", "--k", "@k.npy", "--v", "@v.npy", "--batch", "0", "--head", "1", "--alibi", "@bias2.npy"],
     "--alibi: expected slopes (H,) or (B, H) in bias2.npy, got shape (2, 3, 5)"),
    (["--q", "@q.npy", "--k", "@k.npy", "--v", "@v.npy", "--sinks", "@five.npy"],
     "--sinks: expected logits (H,) one per head, or (H, L) or (B, H, L) one per query row (L = 3) in five.npy, "
     "got shape (1, 1, 1, 1, 2)"),
    (["--q", "@q.npy", "--k", "@k.npy", "--v", "@v.npy", "--batch", "1", "--sinks", "@sinks3.npy"],
     "--sinks: shape (3, 8, 3) holds a batch of 3, q's is 2"),
    (["--q", "@q.npy", "--k", "@k.npy", "--v", "@v.npy", "--batch", "1", "--keep", "@keep3.npy"],
     "--keep: shape (3, 8, 3, 5) holds a batch of 3, q's is 2"),
    (["--q", "@q3.npy", "--k", "@k.npy", "--v", "@v.npy", "--head", "1"],
     "--k: shape (2, 2, 5, 4) holds a batch of 2; q has none to pick it from with --batch"),
    (["--q", "@q.npy", "--k", "@k.npy", "--v", "@v.npy", "--batch", "0", "--alibi", "@three.npy"],
     "--alibi: expected a shape that broadcasts to (..., H) = (8,), got (3,)"),
    (["--q", "@empty.npy", "--k", "1,0", "--v", "1,0"], "--q: expected an array of numbers in empty.npy, got an empty"),
    (["--q", "@none.npz", "--k", "1,0", "--v", "1,0"], "--q: none.npz holds no arrays"),
    (["--q", "@folder.npy", "--k", "1,0", "--v", "1,0"], "--q: 'folder.npy' is a folder, not a file"),
    (["--q", "1,0", "--k", "1,0", "--v", "1,0", "--batch", "7"], "--batch: picks from q of shape (B, H, L, D)"),
    (["--q", "@q.npy", "--k", "@k.npy", "--v", "@v.npy", "--batch", "2"], "--batch: expected a batch index below 2"),
    (["--q", "@q.npy", "--k", "@k.npy", "--v", "@v.npy", "--batch", "0", "--head", "8"],
     "--head: expected a head below q's 8"),
    (["--q", "@q.npy", "--k", "@k.npy", "--v", "@v.npy", "--batch", "0", "--head", "x"],
     "--head: expected an integer"),
    (["--q", "1,0", "--k", "1,0", "--v", "1,0", "--head", "0"], "--head: q has no head axis"),
    (["--head", "1"], "--head: picks from inputs read from files"),
    (["--random", "2", "2", "2", "--batch", "1"], "--batch: picks from inputs read from files"),
    (["--q", "@five.npy", "--k", "1,0", "--v", "1,0", "--batch", "0"], "--batch: picks from q of shape (B, H, L, D), "
     "got shape (1, 1, 1, 1, 2)"),
]


@pytest.mark.parametrize("argv,msg", BAD_FILES, ids=[" ".join(a) for a, _ in BAD_FILES])
def test_files_it_cannot_take_give_one_line_errors(capsys, files, tmp_path, argv, msg):
    _bad_files(tmp_path)
    rc, out, err = run(capsys, "explain", *argv)
    assert rc == 1 and out == "", err
    assert len(err.strip().splitlines()) == 1 and msg in err and "Traceback" not in err, err


def test_pt_files_of_other_tensors(capsys, tmp_path, monkeypatch):
    """Not a tensor, a complex one: refused; sparse and bfloat16 ones: read."""
    torch = pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    torch.save({"q": torch.ones(2, 2)}, "d.pt")
    torch.save(torch.ones(1, 2, dtype=torch.complex64), "c.pt")
    torch.save(torch.eye(2).to_sparse(), "s.pt")
    torch.save(torch.tensor([[0.5, 0.25]], dtype=torch.bfloat16), "b.pt")
    for path, msg in (("d.pt", "got not a tensor"), ("c.pt", "got a complex64 array of shape (1, 2)")):
        rc, out, err = run(capsys, "explain", "--q", "@" + path, "--k", "1,0", "--v", "1,0")
        assert rc == 1 and f"--q: expected an array of numbers in {path}, {msg}" in err, err
    inputs, _ = explained(capsys, "--q", "@b.pt", "--k", "@s.pt", "--v", "@s.pt")
    assert inputs["q"].tolist() == [[0.5, 0.25]] and inputs["k"].tolist() == [[1.0, 0.0], [0.0, 1.0]]


def test_files_over_the_size_limit_are_refused_before_they_are_read(capsys, files, monkeypatch):
    """Arrays over matrices.MAX_FILE_BYTES get a one-line error before they are read: a
    .npy by its header (a sparse 2 GiB file, refused at once with the real limit), an
    .npz member by its unpacked size (a small file can hold a huge array) while a small
    member of the same archive is read, a .pt and a text file (a 16th of the limit) by
    their sizes; an array at the limit is read."""
    from attnkit import matrices
    with open("huge.npy", "wb") as f:                    # (2 GiB of float64 declared, no disk used)
        np.lib.format.write_array_header_1_0(f, {"descr": "<f8", "fortran_order": False, "shape": (1 << 14, 1 << 14)})
        f.truncate(f.tell() + (1 << 31))
    np.savez_compressed("big.npz", q=np.zeros((4, 1000)), k=np.ones((1, 2)))   # q: 32 KB in a ~1 KB file
    np.save("big.npy", np.zeros((2, 500)))               # 8,000 bytes of values
    np.savetxt("big.csv", np.zeros((3, 100)), delimiter=",")
    cases = [("@huge.npy", "huge.npy holds 2,048.0 MiB, over the 1,024.0 MiB")]
    torch = pytest.importorskip("torch")
    torch.save(torch.zeros(2, 1000, dtype=torch.float64), "big.pt")
    for limit, more in ((None, cases), (7999, [("@big.npz:q", "big.npz:q holds 32,128 bytes, over the 7,999 bytes"),
                                               ("@big.npy", "big.npy holds 8,000 bytes, over the 7,999 bytes"),
                                               ("@big.csv", "big.csv holds 7,500 bytes, over the 499 bytes"),
                                               ("@big.pt", "big.pt holds")])):
        if limit is not None:
            monkeypatch.setattr(matrices, "MAX_FILE_BYTES", limit)
        for arg, what in more:
            rc, out, err = run(capsys, "explain", "--q", arg, "--k", "1,0", "--v", "1,0")
            assert rc == 1 and out == "" and len(err.strip().splitlines()) == 1, err
            assert f"--q: {what}" in err and "explain reads; save the heads you want" in err, err
    rc, out, err = run(capsys, "explain", "--q", "@big.npz:k", "--k", "1,0", "--v", "1,0")   # a small member
    assert rc == 0, err
    monkeypatch.setattr(matrices, "MAX_FILE_BYTES", 8000)   # the .npy's values exactly: read
    rc, out, err = run(capsys, "explain", "--q", "@big.npy", "--k", "@big.npy", "--v", "@big.npy")
    assert rc == 0, err
