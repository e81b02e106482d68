"""The `attnkit` command: explain (worked example, --json, --plot, --report,
--mistakes, errors) and info. main(argv) runs in-process; a few cases run the real
command line in a subprocess."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys

import numpy as np
import pytest

import attnkit
from attnkit.cli import main, parse_matrix
from attnkit.testing import max_error

WORKED = ["q·apple  = 1·1 + 0·0 = 1", "q·cheese = 1·0 + 0·1 = 0",   # dot products 1 and 0
          "√2 ≈ 1.414", "1 / 1.414 ≈ 0.707", "0 / 1.414 = 0",         # scaled: 0.707 and 0
          "e^0.707 ≈ 2.028", "e^0 = 1", "total 3.028",
          "weights: apple 0.670, cheese 0.330",
          "0.670·(10, 0) + 0.330·(0, 10) = (6.70, 3.30)"]


def run(capsys, *argv):
    """(exit status, stdout, stderr) of main(argv); argparse's usage errors exit."""
    try:
        rc = main(list(argv))
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def cli(*argv):
    """The real command line, in a fresh interpreter."""
    return subprocess.run([sys.executable, "-m", "attnkit.cli", *argv], capture_output=True,
                          text=True, timeout=120)


# ---- the worked example ------------------------------------------------------------
def test_worked_example_numbers_exactly(capsys):
    rc, out, err = run(capsys, "explain")
    assert rc == 0 and err == ""
    for s in WORKED:
        assert s in out, s
    reading = [line for line in out.splitlines() if line.startswith("Reading:")]
    assert len(reading) == 1 and "apple" in reading[0]
    assert max(len(line) for line in out.splitlines()) <= 80


def test_worked_example_from_the_real_command_line():
    r = cli("explain")
    assert r.returncode == 0, r.stderr
    for s in WORKED:
        assert s in r.stdout, s


def test_matrices_from_text_give_the_same_numbers(capsys):
    rc, out, _ = run(capsys, "explain", "--q", "1,0", "--k", "1,0;0,1", "--v", "10,0;0,10",
                     "--labels", "apple,cheese")
    assert rc == 0
    for s in WORKED:
        assert s.replace("q·", "q0·") in out, s


def test_parse_matrix():
    assert parse_matrix(" 1 2 ; 3,4; ", "--q").tolist() == [[1, 2], [3, 4]]
    assert parse_matrix("0,-inf", "--bias").tolist() == [[0, -np.inf]]
    with pytest.raises(ValueError, match="finite"):
        parse_matrix("0,-inf", "--q")
    with pytest.raises(ValueError, match="'a' is not a number"):
        parse_matrix("1,a", "--k")
    with pytest.raises(ValueError, match="not a mask value"):
        parse_matrix("1,2", "--drop", bool)


# ---- --json ---------------------------------------------------------------------------
@pytest.mark.parametrize("argv,kw", [
    (["--random", "5", "7", "4", "--seed", "3", "--causal"], {"causal": True}),
    (["--random", "6", "3", "8", "--causal", "--align", "top_left"], {"causal": True, "align": "top_left"}),
    (["--random", "4", "9", "2", "--window", "1", "none"], {"window": (1, None)}),
    (["--q", "1,0;0,1;1,1", "--k", "1,0;0,1", "--v", "10,0;0,10", "--drop", "0,1;1,1;0,0"],
     {"drop": np.array([[0, 1], [1, 1], [0, 0]], bool)}),
    (["--q", "1,2;3,4", "--k", "1,0;0,1;1,1", "--v", "1;2;3", "--keep", "1,1,0;1,1,1",
      "--bias", "0,-inf,1;0.5,0,0", "--scale", "0.3", "--softcap", "2"],
     {"keep": np.array([[1, 1, 0], [1, 1, 1]], bool),
      "bias": np.array([[0, -np.inf, 1], [0.5, 0, 0]]), "scale": 0.3, "softcap": 2.0}),
    (["--random", "4", "5", "3", "--sinks", "0.5"], {"sinks": np.array([0.5])}),
    (["--random", "3", "5", "2", "--sinks", "0,1,-1"], {"sinks": np.array([[0.0, 1.0, -1.0]])}),
    (["--random", "4", "6", "2", "--alibi", "0.5", "--causal"], {"alibi_slopes": np.array([0.5]), "causal": True}),
    (["--random", "5", "5", "2", "--packed", "2,3", "--causal"],
     {"cu_seqlens_q": np.array([0, 2, 5]), "cu_seqlens_k": np.array([0, 2, 5]), "causal": True}),
    (["--random", "4", "7", "2", "--packed", "2,2", "3,4"],
     {"cu_seqlens_q": np.array([0, 2, 4]), "cu_seqlens_k": np.array([0, 3, 7])}),
    (["--random", "4", "5", "2", "--dropout", "0.3", "--dropout-seed", "9"], {"dropout": 0.3, "seed": 9}),
    (["--random", "4", "5", "2", "--dropout", "0.3"], {"dropout": 0.3, "seed": 0}),
])
def test_json_parses_and_matches_attention(capsys, argv, kw):
    rc, out, err = run(capsys, "explain", "--json", *argv)
    assert rc == 0, err
    d = json.loads(out)
    q, k, v = (np.array(d["inputs"][n]) for n in "qkv")
    ref_out, ref_lse, ref_w = attnkit.attention(q, k, v, return_lse=True, return_weights=True, **kw)
    steps = d["steps"]
    lse = np.array([-np.inf if x is None else x for x in steps["lse"]])
    assert max_error(np.array(steps["out"]), ref_out) <= 1e-12
    assert max_error(np.array(steps["weights"]), ref_w) <= 1e-12
    assert max_error(lse, ref_lse) <= 1e-12
    assert d["scale"] == pytest.approx(kw.get("scale", 1 / np.sqrt(q.shape[-1])), rel=1e-15)


def test_json_of_the_worked_example(capsys):
    rc, out, _ = run(capsys, "explain", "--json")
    d = json.loads(out)
    assert rc == 0 and d["labels"]["keys"] == ["apple", "cheese"]
    assert np.allclose(d["steps"]["out"], [[6.7, 3.3]], atol=0.005)


def test_random_is_seeded(capsys):
    a = run(capsys, "explain", "--random", "2", "3", "4", "--seed", "7", "--json")[1]
    b = run(capsys, "explain", "--random", "2", "3", "4", "--seed", "7", "--json")[1]
    c = run(capsys, "explain", "--random", "2", "3", "4", "--seed", "8", "--json")[1]
    assert a == b != c


# ---- figures and the report -----------------------------------------------------------
def _check_png(path, min_h, min_w):
    import matplotlib.image as mpimg
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] >= min_h and img.shape[1] >= min_w
    rgb = img[..., :3].reshape(-1, 3)
    assert rgb.std() > 0.05                                  # not blank, not one colour
    assert len(np.unique((rgb * 255).round().astype(np.uint8), axis=0)) > 20
    dark = (rgb.mean(axis=1) < 0.5).mean()
    assert 0.01 < dark < 0.9                                 # real ink on a light page
    return img


def test_plot_png_of_the_worked_example(capsys, tmp_path):
    path = tmp_path / "apple.png"
    rc, out, err = run(capsys, "explain", "--plot", str(path))
    assert rc == 0, err
    assert "(6.70, 3.30)" in out and f"wrote {path}" in out
    img = _check_png(path, 200, 600)
    # the weights panel: apple's cell darker (higher weight) than cheese's, Blues colormap
    h, w = img.shape[:2]
    row = img[h // 2, w // 3: 2 * w // 3, :3]
    assert row.min() < 0.6 and row.max() > 0.6


def test_plot_png_random_causal_and_svg(capsys, tmp_path):
    png = tmp_path / "r.png"
    assert run(capsys, "explain", "--random", "5", "7", "4", "--causal", "--plot", str(png))[0] == 0
    _check_png(png, 300, 800)
    svg = tmp_path / "r.svg"
    assert run(capsys, "explain", "--random", "30", "40", "8", "--plot", str(svg))[0] == 0
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text and len(text) > 10_000


def test_plot_with_json_keeps_stdout_pure_json(capsys, tmp_path):
    path = tmp_path / "x.png"
    rc, out, err = run(capsys, "explain", "--json", "--plot", str(path))
    assert rc == 0 and json.loads(out) and f"wrote {path}" in err and path.stat().st_size > 1000


def test_report_is_self_contained_html(capsys, tmp_path):
    folder = tmp_path / "report" / "nested"
    rc, out, err = run(capsys, "explain", "--report", str(folder))
    assert rc == 0, err
    page = (folder / "index.html").read_text(encoding="utf-8")
    assert page.startswith("<!doctype html>") and page.rstrip().endswith("</html>")
    for s in WORKED + ["Common mistakes", "entropy"]:
        assert s in page.replace("&#x27;", "'"), s
    images = re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page)
    assert len(images) == 2
    for b64 in images:
        data = base64.b64decode(b64)
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert "src='http" not in page and 'src="http' not in page     # nothing fetched


# ---- --mistakes ---------------------------------------------------------------------------
def test_mistakes_table_shows_entropy_falling_only_without_scaling(capsys):
    rc, out, _ = run(capsys, "explain", "--mistakes")
    assert rc == 0
    rows = [line.split() for line in out.splitlines()
            if re.fullmatch(r"\s+\d+\s+[\d.]+\s+[\d.]+\s+[\d.]+", line)]
    d_k = [int(r[0]) for r in rows]
    scaled, unscaled = (np.array([float(r[i]) for r in rows]) for i in (1, 2))
    assert d_k == [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    assert np.all(np.diff(unscaled) < 0) and unscaled[-1] < 0.2 and unscaled[0] > 3.0
    assert np.ptp(scaled) < 0.2 and scaled.min() > 3.0            # ln 64 = 4.16
    for s in ("Mixing up the roles", "(6.70, 3.30)", "keys and values swapped", "blend",
              "Order blindness", "positional"):
        assert s in out, s
    assert max(len(line) for line in out.splitlines()) <= 80


def test_mistakes_json_and_plot(capsys, tmp_path):
    rc, out, _ = run(capsys, "explain", "--mistakes", "--json")
    e = json.loads(out)["entropy"]
    assert rc == 0 and e["d_k"][0] == 2 and e["d_k"][-1] == 1024
    assert e["unscaled"][-1] < 0.1 * e["unscaled"][0]
    path = tmp_path / "entropy.png"
    rc, out, _ = run(capsys, "explain", "--mistakes", "--plot", str(path))
    assert rc == 0 and f"wrote {path}" in out
    _check_png(path, 300, 500)


# ---- errors: one line on stderr, non-zero exit, never a traceback --------------------------
BAD = [
    (["--q", "1,0;1", "--k", "1,0", "--v", "1,0"], "--q: row 2 has 1 value but row 1 has 2"),
    (["--q", "1,0", "--k", "1,0,0;0,1,0", "--v", "1;2"], "k: expected last dim D=2"),
    (["--q", "1,0", "--k", "1,0;0,1", "--v", "1;2;3"], "v: expected shape"),
    (["--q", "1,0", "--k", "1,0"], "--v: required"),
    (["--q", "1,x", "--k", "1,0", "--v", "1"], "'x' is not a number"),
    (["--random", "2", "3"], "expected 3 arguments"),
    (["--random", "2", "0", "3"], "--random: expected an integer >= 1"),
    (["--random", "2", "3", "4", "--q", "1,0"], "not both"),
    (["--drop", "1,1;0,0"], "drop: expected a shape that broadcasts"),
    (["--keep", "1,2"], "not a mask value"),
    (["--window", "1", "x"], "--window: expected an integer or none"),
    (["--window", "-1", "2"], "--window: expected an integer >= 0"),
    (["--labels", "a,b,c"], "labels: expected 2 labels, got 3"),
    (["--plot", "weights.txt"], "expected a file ending in .png, .svg or .pdf"),
    (["--plot", "/nonexistent/folder/x.png"], "cannot write /nonexistent/folder/x.png"),
    (["--align", "middle"], "invalid choice"),
    (["--mistakes", "--random", "2", "3", "4"], "--mistakes: uses its own random inputs; drop --random"),
    (["--mistakes", "--sinks", "1"], "--mistakes: uses its own random inputs; drop --sinks"),
    (["--random", "2", "3", "4", "--seed", "-5"], "--seed: expected an integer >= 0, got -5"),
    (["--random", "2", "3", "4", "--seed", "x"], "--seed: expected an integer, got 'x'"),
    (["--random", "20000", "20000", "4"], "--random: explain keeps every step of the 20000 × 20000 "
                                          "score matrix; 400,000,000 scores is over its limit of 1,000,000"),
    (["--random", "2", "2", "1000000"], "--random: explain shows every value; 2,000,000 values in q"),
    (["--packed", "20000", "20000"], "--packed: explain keeps every step of the 20000 × 20000"),
    (["--random", "5", "5", "2", "--packed", "2,2"],
     "--packed: the lengths 2,2 add up to 4, but there are 5 queries"),
    (["--random", "4", "5", "2", "--packed", "2,2", "2,2"],
     "--packed: the lengths 2,2 add up to 4, but there are 5 keys"),
    (["--packed", "1", "2", "3"], "--packed: expected one list of lengths (queries and keys alike) or two"),
    (["--packed", "2,x"], "--packed: expected an integer, got 'x'"),
    (["--packed", "2,0"], "--packed: expected an integer >= 1, got 0"),
    (["--packed", "2,3", "5"], "--packed: 2 query lengths but 1 key length"),
    (["--q", "1,0", "--k", "1,0;0,1", "--v", "1;2", "--packed", "2"],
     "--packed: the lengths 2 add up to 2, but there is 1 query"),
    (["--random", "3", "4", "2", "--sinks", "1,2"],
     "--sinks: expected 1 value (one sink logit for every query) or one row of L = 3"),
    (["--q", "1,0;0,1", "--k", "1,0;0,1", "--v", "1,0;0,1", "--sinks", "1;2"], "got 2 rows of 1"),
    (["--sinks", "nan"], "--sinks: values must be finite"),
    (["--alibi", "x"], "--alibi: expected a number, got 'x'"),
    (["--alibi", "inf"], "--alibi: expected a finite number, got 'inf'"),
    (["--scale", "nan"], "--scale: expected a finite number, got 'nan'"),
    (["--softcap", "0"], "--softcap: expected a positive finite number, got '0'"),
    (["--dropout", "1.5"], "--dropout: expected a probability 0 <= p < 1, got '1.5'"),
    (["--dropout", "x"], "--dropout: expected a number, got 'x'"),
    (["--dropout-seed", "3"], "--dropout-seed: only used with --dropout P"),
    (["--dropout", "0.5", "--dropout-seed", "-1"], "--dropout-seed: expected an integer >= 0, got -1"),
    (["--dropout", "0.5", "--dropout-seed", str(2 ** 64)], "--dropout-seed: expected an integer below"),
    (["--plot", ""], "--plot: expected a file name, got an empty one"),
    (["--report", ""], "--report: expected a folder name, got an empty one"),
]


@pytest.mark.parametrize("argv,msg", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_one_line_error(capsys, argv, msg):
    rc, out, err = run(capsys, "explain", *argv)
    assert rc != 0 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert msg in err and "Traceback" not in err


def test_unwritable_outputs(capsys, tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a folder")
    rc, out, err = run(capsys, "explain", "--report", str(blocker / "sub"))
    assert rc != 0 and out == "" and "cannot write" in err and len(err.strip().splitlines()) == 1
    rc, out, err = run(capsys, "explain", "--plot", str(blocker / "x.png"))
    assert rc != 0 and "cannot write" in err and out == ""       # checked before any output


def test_bad_matrix_from_the_real_command_line():
    r = cli("explain", "--q", "1,0;1", "--k", "1,0;0,1", "--v", "1,0;0,1")
    assert r.returncode != 0 and r.stdout == ""
    assert r.stderr.strip() == "attnkit explain: error: --q: row 2 has 1 value but row 1 has 2 in '1,0;1'"


def test_missing_matplotlib_says_how_to_install(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)          # import matplotlib -> ImportError
    for argv in (["--plot", str(tmp_path / "x.png")], ["--report", str(tmp_path / "r")],
                 ["--mistakes", "--plot", str(tmp_path / "e.png")]):
        rc, out, err = run(capsys, "explain", *argv)
        assert rc != 0 and out == "" and "pip install 'attnkit[plot]'" in err
        assert len(err.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())
    rc, out, _ = run(capsys, "explain")                            # the base package still explains
    assert rc == 0 and "(6.70, 3.30)" in out


def test_info_still_works(capsys):
    rc, out, _ = run(capsys, "info")
    assert rc == 0 and out.startswith("attnkit backends on this machine:") and "reference" in out


def test_random_size_cap_allocates_nothing(capsys, monkeypatch):
    monkeypatch.setattr(np.random, "default_rng", lambda *a: pytest.fail("allocated"))
    rc, out, err = run(capsys, "explain", "--random", "20000", "20000", "4")
    assert rc == 1 and out == "" and "over its limit" in err


# ---- the command itself: --version, bare attnkit, python -m attnkit ----------------------
def test_version(capsys):
    rc, out, err = run(capsys, "--version")
    assert rc == 0 and out.strip() == f"attnkit {attnkit.__version__}" and err == ""


def test_bare_attnkit_lists_the_commands_and_succeeds(capsys):
    rc, out, err = run(capsys)
    assert rc == 0 and err == "" and out.startswith("usage: attnkit")
    for cmd in ("explain", "info", "bench", "--version"):
        assert cmd in out, cmd


def test_python_dash_m_attnkit():
    r = subprocess.run([sys.executable, "-m", "attnkit", "explain"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    for s in WORKED:
        assert s in r.stdout, s
    r = subprocess.run([sys.executable, "-m", "attnkit"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage: attnkit")


# ---- honest text -----------------------------------------------------------------------------
def test_overflowing_scores_print_the_honest_text(capsys):
    rc, out, err = run(capsys, "explain", "--q", "1e200,1e200", "--k", "1e200,1e200;1,1", "--v", "1,0;0,1")
    assert rc == 0, err
    text = " ".join(out.split())
    assert "q0's row is NaN because a non-finite value reached its softmax: q0·k0 overflowed to inf" in text
    assert "Reading: q0's output is NaN" in text and "attnkit never turns NaN into numbers" in text
    for lie in ("(not NaN)", "nan%", "every key is excluded", "almost alone"):
        assert lie not in text, lie
    rc, out, _ = run(capsys, "explain", "--json", "--q", "1e200,1e200", "--k", "1e200,1e200;1,1",
                     "--v", "1,0;0,1")
    d = json.loads(out)
    assert rc == 0 and d["steps"]["weights"] == [["nan", "nan"]] and d["steps"]["scores"][0][0] == "inf"


@pytest.mark.parametrize("argv", [["--q", "1,0", "--k", "1,0;0,1", "--v", "10,0;0,10"],
                                  ["--random", "3", "4", "2"], ["--packed", "2,3"]])
def test_own_inputs_are_not_called_the_worked_example(capsys, argv):
    rc, out, _ = run(capsys, "explain", *argv)
    assert rc == 0 and "worked example" not in out and "seed's" not in out and "rung" not in out
    if argv[0] != "--q":
        assert "Random inputs: q, k, v drawn from a normal distribution with --seed 0, the seed of " \
               "the random numbers" in " ".join(out.split())
    assert max(len(line) for line in out.splitlines()) <= 80


def test_help_has_no_internal_words(capsys):
    rc, out, _ = run(capsys, "explain", "--help")
    assert rc == 0 and "seed's" not in out and "rung" not in out
    for flag in ("--sinks", "--alibi", "--packed", "--dropout", "--dropout-seed"):
        assert flag in out, flag


def test_report_on_own_inputs_is_headed_as_such(capsys, tmp_path):
    rc, _, err = run(capsys, "explain", "--random", "3", "4", "2", "--sinks", "1", "--report", str(tmp_path / "r"))
    assert rc == 0, err
    page = (tmp_path / "r" / "index.html").read_text(encoding="utf-8")
    assert "<h2>Your inputs, step by step</h2>" in page and "<h2>The worked example</h2>" not in page
    assert "Random inputs" in page and "<th>sink</th>" in page
    rc, _, _ = run(capsys, "explain", "--causal", "--report", str(tmp_path / "e"))
    assert "<h2>The worked example</h2>" in (tmp_path / "e" / "index.html").read_text(encoding="utf-8")


# ---- the new terms -----------------------------------------------------------------------------
def test_packed_alone_is_two_random_sequences_side_by_side(capsys):
    rc, out, _ = run(capsys, "explain", "--packed", "2,3", "--seed", "4", "--json")
    d = json.loads(out)
    assert rc == 0 and d["shapes"]["q"] == [5, 2] and d["cu_seqlens_q"] == [0, 2, 5]
    q = np.random.default_rng(4).standard_normal((5, 2))
    np.testing.assert_array_equal(np.array(d["inputs"]["q"]), q)
    ex = np.array(d["steps"]["excluded"])
    assert ex.tolist() == [[False, False, True, True, True]] * 2 + [[True, True, False, False, False]] * 3
    rc, out, _ = run(capsys, "explain", "--packed", "2,3")
    lines = out.splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("Step 2d"))
    assert [x.split()[1:] for x in lines[at + 2: at + 7]] == [list("··xxx")] * 2 + [list("xx···")] * 3


def test_sinks_alibi_dropout_text(capsys):
    rc, out, _ = run(capsys, "explain", "--sinks", "0.5", "--alibi", "0.5", "--dropout", "0.5",
                     "--dropout-seed", "3")
    text = " ".join(out.split())
    assert rc == 0
    for s in ("masks: ALiBi (slope 0.5), sinks, dropout 0.5 (seed 3)", "then ALiBi (slope 0.5):",
              "sink e^0.500", "Step 3a dropout p = 0.5 (dropout seed 3)", "The sink takes"):
        assert s in text, s


def test_plot_title_names_the_masks(capsys, monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    from attnkit import plot
    figs = []
    save = plot.save
    monkeypatch.setattr(plot, "save", lambda fig, path: (figs.append(fig), save(fig, path))[1])
    path = tmp_path / "p.png"
    rc, out, err = run(capsys, "explain", "--packed", "2,3", "--causal", "--alibi", "0.5", "--sinks", "0",
                       "--dropout", "0.2", "--plot", str(path))
    assert rc == 0, err
    title = figs[0]._suptitle.get_text()
    assert title.endswith("masks: ALiBi (slope 0.5), causal (bottom_right), packed (2 sequences), "
                          "sinks, dropout 0.2 (seed 0)")
    assert [ax.get_title().split()[0] for ax in figs[0].axes if ax.get_title()] == [
        "ALiBi", "scores", "weights", "after", "output"]
    _check_png(path, 300, 1200)


# ---- info ---------------------------------------------------------------------------------------
def test_info_lists_versions_and_the_blas(capsys):
    from importlib import metadata
    rc, out, _ = run(capsys, "info")
    assert rc == 0 and out.startswith("attnkit backends on this machine:")
    assert f"attnkit {attnkit.__version__}, Python " in out
    for dist, label in (("numpy", "NumPy"), ("numba", "numba"), ("threadpoolctl", "threadpoolctl"),
                        ("torch", "torch"), ("triton", "Triton")):
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            version = "not installed"
        assert re.search(rf"^  {label} +{re.escape(version)}$", out, flags=re.M), label
    threadpoolctl = pytest.importorskip("threadpoolctl")
    blas = [x for x in threadpoolctl.threadpool_info() if x["user_api"] == "blas"]
    assert blas
    for lib in blas:
        n = lib["num_threads"]
        assert f"blas    {lib['internal_api']} {lib['version']}: {n} thread" in out
    assert "A rung is one backend" in out


def test_info_without_threadpoolctl(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)
    rc, out, _ = run(capsys, "info")
    assert rc == 0 and "threadpoolctl is not installed" in out and "reference" in out



def test_values_that_start_with_a_minus_sign(capsys):
    """"-1,0" and "-inf,0" would read as options: they are taken as the option's value."""
    rc, out, err = run(capsys, "explain", "--q", "-1,0", "--k", "1,0;0,1", "--v", "1,0;0,1",
                       "--bias", "-inf,0", "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert d["inputs"]["q"] == [[-1.0, 0.0]] and d["steps"]["weights"] == [[0.0, 1.0]]


def test_reading_says_alone_and_equal_when_they_are(capsys):
    rc, out, _ = run(capsys, "explain", "--q", "1,0", "--k", "1,0;0,1", "--v", "1,0;0,1", "--bias", "0,-inf")
    assert rc == 0 and "sees k0 alone (weight 1)" in out
    rc, out, _ = run(capsys, "explain", "--q", "0,0", "--k", "1,0;0,1", "--v", "1,0;0,1")
    assert rc == 0 and "weighs k0, k1 equally (50.0% each)" in out


def test_a_console_without_utf8_gets_replacements_not_a_traceback():
    import os
    env = dict(os.environ, PYTHONIOENCODING="ascii")
    for argv in (["explain", "--help"], ["explain"]):
        r = subprocess.run([sys.executable, "-m", "attnkit.cli", *argv], capture_output=True, text=True,
                           timeout=120, env=env)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-500:]


def test_bench_refuses_torch_backends_for_numpy_arrays(capsys):
    rc, out, err = run(capsys, "bench", "--backend", "torch", "--shape", "1", "1", "16", "8")
    assert rc == 1 and "backend: 'torch' takes torch tensors" in err and "Traceback" not in err


# ---- cases a mutation run found untested ------------------------------------------
def test_packed_alone_with_two_lists_sizes_the_keys_by_the_second(capsys):
    rc, out, err = run(capsys, "explain", "--packed", "2,2", "3,4", "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert d["shapes"]["q"] == [4, 2] and d["shapes"]["k"] == [7, 2] and d["cu_seqlens_k"] == [0, 3, 7]


def test_dropout_of_one_is_refused_naming_the_flag(capsys):
    rc, out, err = run(capsys, "explain", "--dropout", "1")
    assert rc == 1 and out == ""
    assert "--dropout: expected a probability 0 <= p < 1, got '1'" in err


def test_given_inputs_get_no_random_inputs_note(capsys):
    rc, out, _ = run(capsys, "explain", "--q", "1,0", "--k", "1,0;0,1", "--v", "10,0;0,10")
    assert rc == 0 and "Random inputs" not in out


def test_dash_h_after_a_value_option_is_a_usage_error(capsys):
    rc, out, err = run(capsys, "explain", "--q", "-h")
    assert rc == 2 and out == "" and "argument --q: expected one argument" in err


def test_sinks_that_start_with_a_minus_sign(capsys):
    rc, out, err = run(capsys, "explain", "--random", "3", "4", "2", "--sinks", "-0.5,1,2", "--json")
    assert rc == 0, err
    assert json.loads(out)["sinks"] == [[-0.5, 1.0, 2.0]]


def test_window_inf_is_an_unbounded_side(capsys):
    rc, out, err = run(capsys, "explain", "--random", "3", "4", "2", "--window", "inf", "0", "--json")
    assert rc == 0, err
    assert json.loads(out)["window"] == [None, 0]


def test_reading_gives_the_top_weight_to_one_decimal(capsys):
    rc, out, _ = run(capsys, "explain")
    assert rc == 0 and "q weighs apple most (67.0%)" in out


def test_errors_name_the_option_the_user_typed(capsys):
    """A library error that names its argument ("keep: ...") names the option on the
    command line ("--keep: ..."); an unknown option points at the command's help."""
    for argv, flag in ((("--random", "1", "2", "2", "--keep", "1,0,1"), "--keep"),
                       (("--random", "2", "3", "2", "--labels", "a,b"), "--labels"),
                       (("--random", "1", "2", "2", "--query-labels", "a,b"), "--query-labels")):
        rc, out, err = run(capsys, "explain", *argv)
        assert rc == 1 and err.startswith(f"attnkit explain: error: {flag}: "), err
    rc, out, err = run(capsys, "explain", "--frobnicate")
    assert rc == 2 and err.strip().endswith("--frobnicate (see attnkit explain --help)"), err


def test_the_formula_and_the_sink_say_what_was_computed(capsys):
    rc, out, _ = run(capsys, "explain", "--random", "2", "3", "2", "--scale", "2", "--sinks", "1")
    assert rc == 0 and "softmax(Q Kᵀ · 2) V" in out and "softmax(Q Kᵀ / √d_k)" not in out
    assert "the sink's score; its value vector is 0" in " ".join(out.split())
    assert "softmax(Q Kᵀ / √d_k) V" in run(capsys, "explain", "--random", "2", "3", "2")[1]
