"""The flash runtime: the threads knob, concurrent calls, BLAS held to one thread and
restored, no threadpoolctl, and safety after fork and under KeyboardInterrupt."""

import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import attnkit
from attnkit import flash
from attnkit.flash import runtime
from attnkit.spec import validate
from attnkit.testing import make_qkv, max_error


def blas_threads():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    return [i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]


def test_threads_knob():
    old = flash.set_threads(3)
    try:
        assert flash.get_threads() == 3
        with flash.threads(1):
            assert flash.get_threads() == 1
        assert flash.get_threads() == 3
    finally:
        flash.set_threads(old)
    with pytest.raises(ValueError, match="threads"):
        flash.set_threads(0)


def test_set_threads_accepts_numpy_integers_and_rejects_bools():
    old = flash.set_threads(np.int64(2))
    try:
        assert flash.get_threads() == 2 and type(flash.get_threads()) is int
        with flash.threads(np.int32(1)):
            assert flash.get_threads() == 1
    finally:
        flash.set_threads(old)
    for bad in (True, 1.0, np.int64(0), "2"):
        with pytest.raises(ValueError, match="threads"):
            flash.set_threads(bad)
        with pytest.raises(ValueError, match="threads"):
            with flash.threads(bad):
                pass


def test_concurrent_calls_with_different_thread_settings():
    """flash.threads is per context (thread): concurrent calls with different settings
    see their own setting and give serial bits."""
    q, k, v = make_qkv((1, 2, 200, 16), (1, 2, 180, 16), 16, dtype="float32", seed=11)
    spec = validate(q, k, v, causal=True)
    blocks = dict(block_m=16, block_n=32)
    with flash.threads(1):
        want = flash.rung_forward(spec, **blocks)
    sizes = [1, 2, 3, 4, 2, 3]
    barrier = threading.Barrier(len(sizes))
    errors, seen, results = [], [], []

    def worker(n):
        try:
            with flash.threads(n):
                barrier.wait()
                seen.append((n, flash.get_threads()))
                for _ in range(15):
                    results.append(flash.rung_forward(spec, **blocks))
                seen.append((n, flash.get_threads()))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(n,)) for n in sizes]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    assert all(n == got for n, got in seen)
    assert len(results) == 15 * len(sizes)
    for out, lse, _ in results:
        assert np.array_equal(out, want[0]) and np.array_equal(lse, want[1])


def test_overlapping_calls_restore_the_blas_thread_count():
    """BLAS is limited on the first overlapping call's entry and restored on the last
    one's exit, even when the calls end in another order than they began."""
    before = blas_threads()
    if not before or max(before) <= 1:
        pytest.skip("no multi-threaded BLAS found by threadpoolctl")
    a_in, b_in, a_done = threading.Event(), threading.Event(), threading.Event()
    errors = []

    def first(_):
        a_in.set()
        assert b_in.wait(10)
        assert set(blas_threads()) == {1}

    def second(_):
        b_in.set()
        assert a_done.wait(10)
        assert set(blas_threads()) == {1}                # the first call's exit kept the limit

    def call(fn):
        try:
            runtime.run([0], fn)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ta = threading.Thread(target=call, args=(first,))
    ta.start()
    assert a_in.wait(10)
    tb = threading.Thread(target=call, args=(second,))
    tb.start()
    ta.join()
    a_done.set()
    tb.join()
    assert not errors, errors
    assert blas_threads() == before


def test_without_threadpoolctl_runs_serially_with_the_same_results(monkeypatch):
    q, k, v = make_qkv((2, 40, 8), (1, 50, 8), seed=8)
    spec = validate(q, k, v, causal=True)
    want = flash.rung_forward(spec, block_m=8, block_n=8)
    monkeypatch.setattr(runtime._blas, "controller", None)   # as if threadpoolctl were missing
    monkeypatch.setattr(runtime._pool, "grow", lambda n: pytest.fail("no workers without threadpoolctl"))
    got = flash.rung_forward(spec, block_m=8, block_n=8)
    assert max_error(got[0], want[0]) <= 1e-12 and max_error(got[1], want[1]) <= 1e-12


def test_a_task_error_is_raised_after_every_worker_left():
    inside = []

    def fn(t):
        inside.append(t)
        time.sleep(0.01)
        if t == 3:
            raise KeyError("task 3")

    with flash.threads(2), pytest.raises(KeyError, match="task 3"):
        runtime.run(list(range(40)), fn)
    n = len(inside)
    time.sleep(0.1)
    assert len(inside) == n < 40                             # the others stopped: nothing runs on


CHILD = r"""
import multiprocessing as mp, os, sys
import numpy as np
import attnkit
from attnkit.testing import make_qkv

def work(_):
    q, k, v = make_qkv((2, 4, 300, 16), (2, 2, 300, 16), dtype="float32", seed=1)
    return float(attnkit.attention(q, k, v, causal=True).sum())

q, k, v = make_qkv((2, 4, 300, 16), (2, 2, 300, 16), dtype="float32", seed=1)
want = float(attnkit.attention(q, k, v, causal=True).sum())        # the parent used the pool
with mp.get_context("fork").Pool(2) as pool:
    got = pool.map(work, range(4))
assert all(g == want for g in got), (got, want)
pid = os.fork()
if pid == 0:
    os._exit(0 if work(0) == want else 3)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
print("ok")
"""


def test_fork_children_after_use_in_the_parent():
    """multiprocessing's fork pool and a bare os.fork() child both compute after the
    parent used the worker pool and the BLAS thread (no hang)."""
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


STORM = r"""
import signal, threading, time, _thread, sys
import numpy as np
import attnkit
from attnkit import flash
from attnkit.testing import make_qkv
import threadpoolctl

def blas():
    return [i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]

before = blas()
q, k, v = make_qkv((1, 4, 200, 16), (1, 4, 200, 16), dtype="float32", seed=2)
want = attnkit.attention(q, k, v, causal=True, backend="flash")
stop = False
armed = False

def on_interrupt(signum, frame):
    # Ctrl-C inside the library calls only: the handler disarms itself as it raises, and
    # the loop arms it inside its try, so no interrupt can land in the test's own code
    global armed
    if armed:
        armed = False
        raise KeyboardInterrupt

signal.signal(signal.SIGINT, on_interrupt)

def storm():
    rng = np.random.default_rng(0)
    while not stop:
        time.sleep(float(rng.uniform(0, 0.003)))
        _thread.interrupt_main()

t = threading.Thread(target=storm, daemon=True)
hits = calls = 0
deadline = time.time() + 8
t.start()
while time.time() < deadline:
    try:
        calls += 1
        armed = True
        with flash.threads(2):
            attnkit.attention(q, k, v, causal=True, backend="flash")
        armed = False
    except KeyboardInterrupt:
        hits += 1
stop = True
t.join()
got = attnkit.attention(q, k, v, causal=True, backend="flash")
assert np.array_equal(got, want)
time.sleep(0.5)
assert blas() == before, (blas(), before)
print("ok", hits, calls)
"""


def test_interrupt_storm_leaves_pool_locks_and_blas_intact():
    """KeyboardInterrupt at random points of many short calls: afterwards calls give
    the same bits, BLAS has its thread count back, nothing hangs."""
    r = subprocess.run([sys.executable, "-c", STORM], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("ok"), (r.stdout, r.stderr[-3000:])
    _, hits, calls = r.stdout.split()
    assert int(hits) > 20                                   # the storm really hit calls


def test_a_threadpoolctl_error_is_raised_and_the_next_call_works(monkeypatch):
    """An error inside the BLAS-limit thread (threadpoolctl failing once) reaches the
    call that asked, named, and the thread lives on: the next call neither hangs nor
    fails, and BLAS ends with its thread count."""
    ctl = runtime.blas_controller()
    if ctl is None:
        pytest.skip("threadpoolctl is not installed")
    before = [i["num_threads"] for i in ctl.info()]
    orig, calls = ctl.limit, []

    def flaky(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise OSError("hiccup")
        return orig(*a, **kw)

    monkeypatch.setattr(ctl, "limit", flaky)
    q = np.ones((1, 4, 300, 16), np.float32)
    results = []

    def call():
        try:
            results.append(attnkit.attention(q, q, q, backend="flash"))
        except RuntimeError as e:
            results.append(e)

    for _ in range(2):
        t = threading.Thread(target=call, daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive(), "attention hung after a threadpoolctl error"
    assert isinstance(results[0], RuntimeError) and "hold BLAS to one thread" in str(results[0])
    assert "OSError: hiccup" in str(results[0])
    assert np.allclose(results[1], 1.0)
    assert [i["num_threads"] for i in ctl.info()] == before
