"""The flash runtime: the threads knob, concurrent calls, BLAS held to one thread and
restored, no threadpoolctl, and safety after fork and under KeyboardInterrupt."""

import contextlib
import subprocess
import sys
import threading
import time
import weakref
from types import SimpleNamespace

import numpy as np
import pytest

import attnkit
from attnkit import flash
from attnkit.flash import blas, runtime
from attnkit.spec import validate
from attnkit.testing import make_qkv, max_error


def use_pool(monkeypatch):
    """Tasks on attnkit's own pool even where torch's OpenMP team is available."""
    monkeypatch.setattr(runtime, "_omp", [None])


@pytest.fixture(params=["pool", "team"])
def executor(request, monkeypatch):
    """Each of the two ways tasks run beside the caller: the pool, torch's OpenMP team."""
    if request.param == "pool":
        use_pool(monkeypatch)
    else:
        pytest.importorskip("torch")
        if runtime._omp_team(2) is None:
            pytest.skip("torch's OpenMP runtime is not GNU libgomp here")
    return request.param


@pytest.fixture(params=["thread", "inline"])
def blas_path(request, monkeypatch):
    """Each of the two ways the BLAS limit is set and restored: by the dedicated BLAS
    thread (threadpoolctl), or by the calls themselves (one pthreads OpenBLAS)."""
    if runtime.blas_controller() is None:
        pytest.skip("threadpoolctl is not installed")
    direct = runtime._one_pthreads_openblas(runtime.blas_controller())
    if request.param == "inline" and direct is None:
        pytest.skip("NumPy's BLAS is not one pthreads OpenBLAS here")
    monkeypatch.setattr(runtime._blas, "direct", direct if request.param == "inline" else None)
    return request.param


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


def test_overlapping_calls_restore_the_blas_thread_count(blas_path):
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


def test_a_task_error_is_raised_after_every_worker_left(executor):
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
from attnkit.flash import blas as flash_blas
from attnkit.testing import make_qkv
import threadpoolctl
flash_blas.small_product_limit = lambda: 0             # whole tiles: the calls hold BLAS

def blas():
    return [i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]

before = blas()
q, k, v = make_qkv((2, 4, 300, 16), (2, 2, 300, 16), dtype="float32", seed=2)
want = attnkit.attention(q, k, v, causal=True, backend="flash")
from attnkit.flash.plan import Call
from attnkit.spec import validate
assert len(Call(validate(q, k, v, causal=True), None, None).units) >= 2   # several tasks: workers take part
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


def test_a_blas_limit_error_is_raised_and_the_next_call_works(monkeypatch, blas_path):
    """An error while BLAS is limited (threadpoolctl on the BLAS thread, or OpenBLAS's
    own setter, failing once) reaches the call that asked, named, and nothing is left
    broken: the next call neither hangs nor fails, and BLAS ends with its thread count."""
    ctl = runtime.blas_controller()
    before = [i["num_threads"] for i in ctl.info()]
    owner, name = (ctl, "limit") if blas_path == "thread" else (runtime._blas.direct, "set_num_threads")
    orig, calls = getattr(owner, name), []

    def flaky(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise OSError("hiccup")
        return orig(*a, **kw)

    monkeypatch.setattr(owner, name, flaky)
    monkeypatch.setattr(blas, "small_product_limit", lambda: 0)   # whole tiles: products that may thread
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


# ---- the pool's mechanics: workers really take tasks, the knob sets how many ------------
def test_workers_take_tasks_and_their_number_follows_the_threads_setting(monkeypatch):
    """With n threads, n - 1 pool workers are started (never more) and they run tasks
    beside the caller: n tasks that each wait for all n to be running at once complete
    only if n threads take them."""
    if runtime.blas_controller() is None:
        pytest.skip("without threadpoolctl the tiles run on the calling thread")
    use_pool(monkeypatch)
    monkeypatch.setattr(runtime, "_pool", runtime._Pool())       # a fresh pool: no workers yet
    for n, setting in ((2, flash.threads), (3, None)):
        barrier = threading.Barrier(n, timeout=20)
        seen = []

        def fn(t, seen=seen, barrier=barrier):
            seen.append(threading.get_ident())
            barrier.wait()

        if setting is None:
            old = flash.set_threads(n)
            try:
                runtime.run(list(range(n)), fn)
            finally:
                flash.set_threads(old)
        else:
            with setting(n):
                runtime.run(list(range(n)), fn)
        assert len(set(seen)) == n and threading.get_ident() in seen
        assert len(runtime._pool.workers) == n - 1
        assert all(t.is_alive() and t.daemon for t in runtime._pool.workers)
    with flash.threads(2):                                       # enough workers: none started
        runtime.run([0, 1, 2], lambda t: None)
    assert len(runtime._pool.workers) == 2


def test_a_nested_call_on_a_worker_runs_inline(monkeypatch):
    """A call made inside a task that runs on a pool worker runs its tasks on that worker
    and makes no job of its own (it would wait on workers that may all be busy)."""
    if runtime.blas_controller() is None:
        pytest.skip("without threadpoolctl the tiles run on the calling thread")
    use_pool(monkeypatch)
    main = threading.get_ident()
    jobs, nested = [], []
    real_job = runtime._Job

    class Job(real_job):
        def __init__(self, *a):
            jobs.append(threading.get_ident())
            super().__init__(*a)

    monkeypatch.setattr(runtime, "_Job", Job)
    barrier = threading.Barrier(2, timeout=20)

    def outer(t):
        barrier.wait()                                           # one task on the caller, one on a worker
        if threading.get_ident() != main:
            assert runtime._local.worker is True
            runtime.run(list(range(6)), lambda i: nested.append(threading.get_ident()))

    with flash.threads(2):
        runtime.run([0, 1], outer)
    assert jobs == [main]                                        # only the outer call made a job
    assert len(nested) == 6 and len(set(nested)) == 1 and nested[0] != main


def test_grow_with_enough_workers_takes_no_lock(monkeypatch):
    """grow() returns at once when the pool is big enough: it neither takes the pool's
    lock (held across a fork by the fork hook) nor touches the fork hooks."""
    pool = runtime._Pool()

    class Refuse:
        def __enter__(self):
            pytest.fail("grow took the pool's lock with enough workers")

        def __exit__(self, *a):
            return False

    pool.lock = Refuse()
    monkeypatch.setattr(runtime, "_register_fork_hooks", lambda: pytest.fail("fork hooks touched"))
    pool.grow(0)
    pool.workers.append(threading.current_thread())
    pool.grow(1)


def test_fork_hooks_are_registered_by_the_first_worker_and_by_the_blas_thread(monkeypatch):
    registered = []
    monkeypatch.setattr(runtime, "_fork_hooks", [])
    monkeypatch.setattr(runtime.os, "register_at_fork", lambda **kw: registered.append(sorted(kw)))
    runtime._Pool().grow(1)
    assert registered == [["after_in_child", "after_in_parent", "before"]]
    monkeypatch.setattr(runtime, "_fork_hooks", [])
    b = runtime._Blas()
    b.start()
    assert registered == [["after_in_child", "after_in_parent", "before"]] * 2
    runtime._Blas().start()                                      # registered once only
    assert len(registered) == 2


def test_the_fork_hooks_hold_and_release_both_locks():
    runtime._before_fork()
    try:
        assert runtime._pool.lock.locked() and runtime._blas.lock.locked()
    finally:
        runtime._after_fork_in_parent()
    assert not runtime._pool.lock.locked() and not runtime._blas.lock.locked()


class FakeLimiter:
    def __init__(self, log):
        self.log = log

    def restore_original_limits(self):
        self.log.append("restore")


class FakeController:
    """threadpoolctl's controller, recording what the BLAS thread asks of it."""

    def __init__(self, fail_first=False):
        self.log, self.fail = [], fail_first

    def limit(self, limits, user_api):
        self.log.append(("limit", limits, user_api))
        if self.fail:
            self.fail = False
            raise OSError("hiccup")
        return FakeLimiter(self.log)


def test_after_fork_the_child_starts_over_keeping_the_controller(monkeypatch):
    """In a fork child: a new pool without workers, a new BLAS thread state that keeps
    the (expensive) controller, and a limit the parent held at the fork is undone."""
    ctl = FakeController()
    parent = runtime._Blas()
    parent.controller, parent.limiter = ctl, FakeLimiter(ctl.log)
    pool = runtime._Pool()
    pool.workers.append(threading.current_thread())
    monkeypatch.setattr(runtime, "_blas", parent)
    monkeypatch.setattr(runtime, "_pool", pool)
    runtime._after_fork_in_child()
    assert runtime._pool is not pool and runtime._pool.workers == []
    assert runtime._blas is not parent and runtime._blas.controller is ctl
    assert runtime._blas.limiter is None and runtime._blas.thread is None
    assert ctl.log == ["restore"]
    parent.limiter = None                                        # no limit held at the fork: nothing undone
    monkeypatch.setattr(runtime, "_blas", parent)
    runtime._after_fork_in_child()
    assert ctl.log == ["restore"] and runtime._blas.controller is ctl


def test_after_fork_the_child_undoes_an_inline_limit(monkeypatch):
    """The inline path (one pthreads OpenBLAS): a limit a parent call held at the fork is
    undone in the child (the count saved before it), and the child keeps the setter."""
    log = []
    direct = SimpleNamespace(get_num_threads=lambda: 1, set_num_threads=log.append)
    parent = runtime._Blas()
    parent.controller, parent.direct, parent.saved = None, direct, 6
    tok = runtime._Token()
    parent.held[id(tok)] = weakref.ref(tok)
    monkeypatch.setattr(runtime, "_blas", parent)
    monkeypatch.setattr(runtime, "_pool", runtime._Pool())
    runtime._after_fork_in_child()
    assert log == [6] and runtime._blas.direct is direct and not runtime._blas.held
    monkeypatch.setattr(runtime, "_blas", runtime._Blas())       # nothing held at the fork: nothing set
    runtime._blas.direct = direct
    runtime._after_fork_in_child()
    assert log == [6]


class FakeOpenBLAS:
    """OpenBLAS's get/set thread-count functions; ``interrupt`` makes the next set
    raise KeyboardInterrupt before it sets."""

    def __init__(self, n):
        self.n, self.interrupt, self.log = n, False, []

    def get_num_threads(self):
        return self.n

    def set_num_threads(self, n):
        if self.interrupt:
            self.interrupt = False
            raise KeyboardInterrupt
        self.n = n
        self.log.append(n)


def test_the_inline_limit_survives_an_interrupted_restore_and_ignores_a_stray_exit():
    """Inline path: Ctrl-C inside the last call's restore leaves the count at 1 only
    until the next request, which restores it (and a first call then saves the user's
    count, not 1); an exit whose enter never counted its token (an interrupt before
    it) restores nothing, so a count the user set since stays."""
    blas, lib = runtime._Blas(), FakeOpenBLAS(4)
    blas.direct = lib
    a, b = runtime._Token(), runtime._Token()
    assert blas._inline("enter", a) is None and lib.n == 1
    lib.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        blas._inline("exit", a)
    assert lib.n == 1 and blas.restoring
    assert blas._inline("enter", b) is None and lib.n == 1 and blas.saved == 4
    assert blas._inline("exit", b) is None and lib.n == 4 and not blas.restoring
    lib.n = 3                                                    # the user's own setting
    assert blas._inline("exit", runtime._Token()) is None and lib.n == 3
    assert blas._inline("enter", a) is None and lib.n == 1       # a stray exit while a call is inside:
    lib.log.clear()                                              # never a moment unlimited
    assert blas._inline("exit", runtime._Token()) is None and lib.n == 1 and 3 not in lib.log
    assert blas._inline("exit", a) is None and lib.n == 3
    c = runtime._Token()
    assert blas._inline("enter", c) is None and lib.n == 1
    del c                                                        # died inside, without its exit
    assert blas._inline("enter", a) is None and lib.n == 1 and blas.saved == 3
    assert blas._inline("exit", a) is None and lib.n == 3


def test_the_inline_path_registers_the_fork_hooks(monkeypatch):
    """The fork hooks (which undo a limit held at a fork) are registered by the first
    inline limit too, also where no pool worker or BLAS thread is ever started (tasks
    on torch's team)."""
    registered = []
    monkeypatch.setattr(runtime, "_register_fork_hooks", lambda: registered.append(1))
    monkeypatch.setattr(runtime._blas, "direct", FakeOpenBLAS(2))
    monkeypatch.setattr(runtime._blas, "controller", runtime._blas.controller or object())
    with runtime.blas_single_threaded():
        assert runtime._blas.direct.n == 1
    assert registered and runtime._blas.direct.n == 2


def test_decoding_leaves_blas_alone_and_tiles_hold_it(monkeypatch):
    """A call whose every block runs the compiled streaming kernel (decoding) makes no
    BLAS call, so it asks the BLAS thread for nothing; a call with tiles (matmuls) holds
    BLAS to one thread, on one thread and on two. Same results either way."""
    asked = []
    request = runtime._blas.request
    monkeypatch.setattr(runtime._blas, "request", lambda cmd, tok: asked.append(cmd) or request(cmd, tok))
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 8, 1, 64), dtype=np.float32)
    k, v = (rng.standard_normal((2, 2, 3000, 64), dtype=np.float32) for _ in range(2))
    lengths = np.array([3000, 1234])
    want = attnkit.attention_kvcache(q, k, v, lengths, backend="reference")
    for n in (1, 2):
        with flash.threads(n):
            asked.clear()
            got = attnkit.attention_kvcache(q, k, v, lengths, backend="flash")
            assert asked == [] and max_error(got, want) < 1e-5
            attnkit.attention(np.repeat(q, 64, axis=2), k, v, backend="flash")     # 64 rows · 4 heads: tiles
            assert asked == ["enter", "exit"]


def test_the_blas_thread_limits_once_and_restores_when_the_last_call_leaves():
    """On a private BLAS thread with a recording controller: the limit is applied on the
    first enter, kept while any call is in, restored on the last exit; a failed limit
    is reported to its call and leaves nothing limited; no call is acknowledged twice
    (the thread's periodic wake-ups while calls are in answer nobody)."""
    ctl = FakeController(fail_first=True)
    b = runtime._Blas()
    b.controller = ctl
    t1, t2 = runtime._Token(), runtime._Token()
    assert t1.lock.locked() and not t1.acked
    err = b.request("enter", t1)                                 # threadpoolctl fails once
    assert isinstance(err, RuntimeError) and "hold BLAS to one thread" in str(err)
    assert isinstance(err.__cause__, OSError)                    # threadpoolctl's own error chained
    assert b.request("exit", t1) is None
    assert ctl.log == [("limit", 1, "blas")] and b.limiter is None   # nothing left limited
    ctl.log.clear()
    assert b.request("enter", t1) is None and b.request("enter", t2) is None
    assert ctl.log == [("limit", 1, "blas")]
    t1.acked = t2.acked = False
    time.sleep(0.5)                                              # the thread wakes every 0.2 s meanwhile
    assert not t1.acked and not t2.acked                         # ... and acknowledges nothing
    assert b.request("exit", t1) is None and ctl.log == [("limit", 1, "blas")]
    assert b.request("exit", t2) is None and ctl.log == [("limit", 1, "blas"), "restore"]
    assert b.limiter is None


def test_wait_until_hands_back_an_interrupt_after_handling_it():
    """A KeyboardInterrupt while waiting calls on_interrupt (retried if interrupted
    itself), the wait goes on until done, and the first interrupt is returned."""
    lock = runtime._thread.allocate_lock()
    lock.acquire()
    state = {"checks": 0, "handled": 0, "tries": 0}
    first = KeyboardInterrupt("first")

    def done():
        state["checks"] += 1
        if state["checks"] == 1:
            raise first
        if state["checks"] == 2:
            raise KeyboardInterrupt("second")
        return state["checks"] >= 4

    def on_interrupt():
        state["tries"] += 1
        if state["tries"] == 1:
            raise KeyboardInterrupt("while handling")
        state["handled"] += 1

    got = runtime._wait_until(done, lock, on_interrupt)
    assert got is first and state["checks"] == 4 and state["handled"] == 2
    assert runtime._wait_until(lambda: True, lock, pytest.fail) is None


def test_release_wakes_a_waiter_and_tolerates_a_free_lock():
    lock = runtime._thread.allocate_lock()
    lock.acquire()
    runtime._release(lock)
    assert not lock.locked()
    runtime._release(lock)                                       # already free: no error
    assert not lock.locked()


def test_a_job_wakes_its_caller_when_a_worker_leaves():
    """A job's wake lock starts held; a worker leaving the job releases it (so the caller
    waiting for the workers to leave wakes at once)."""
    ran = []
    job = runtime._Job(ran.append, [1, 2, 3])
    assert job.wake.locked()
    job.join(7)
    assert ran == [1, 2, 3] and not job.inside and not job.wake.locked()


def test_the_default_is_the_cores_this_process_may_use(monkeypatch):
    """No setting: the cores in this process's affinity mask (taskset, cgroups), or
    os.cpu_count() where there is no mask (not Linux), or 1 when even that is unknown."""
    monkeypatch.setattr(runtime, "_default_threads", [None])
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: {0, 1, 2} if pid == 0 else {0}, raising=False)
    assert flash.get_threads() == 3
    monkeypatch.delattr(runtime.os, "sched_getaffinity")
    monkeypatch.setattr(runtime.os, "cpu_count", lambda: 5)
    assert flash.get_threads() == 5
    monkeypatch.setattr(runtime.os, "cpu_count", lambda: None)
    assert flash.get_threads() == 1


def test_wait_until_sleeps_on_the_lock_instead_of_spinning():
    """Between checks the waiter blocks on the lock (a worker leaving releases it): a
    free lock is taken by the wait (the wake-up consumed), so the next check comes only
    after the next release."""
    lock = runtime._thread.allocate_lock()
    checks = []
    assert runtime._wait_until(lambda: checks.append(1) or len(checks) > 1, lock, pytest.fail) is None
    assert lock.locked() and len(checks) == 2


def _error_path_run(monkeypatch, caller_raises, interrupt):
    """runtime.run on 2 threads, 30 tasks: tasks 0 and 1 meet at a barrier (one on the
    caller, one on a worker); the worker's then blocks until the caller waits for it
    to leave; the caller's raises (caller_raises). ``interrupt``: a KeyboardInterrupt
    lands in the caller's wait. Returns (the error raised or None, tasks run)."""
    if runtime.blas_controller() is None:
        pytest.skip("without threadpoolctl the tiles run on the calling thread")
    use_pool(monkeypatch)
    main = threading.get_ident()
    barrier, release = threading.Barrier(2, timeout=20), threading.Event()
    ran = []
    real = runtime._wait_until

    def wait(done, lock, on_interrupt):
        if sys._getframe(1).f_code.co_name != "run":
            return real(done, lock, on_interrupt)
        calls = []

        def done_once():
            if not calls:
                calls.append(1)
                release.set()
                if interrupt:
                    raise KeyboardInterrupt
            return done()
        return real(done_once, lock, on_interrupt)

    def fn(t):
        ran.append(t)
        if t < 2:
            barrier.wait()
            if threading.get_ident() != main:
                assert release.wait(20)
            elif caller_raises:
                raise KeyError("task on the caller")

    monkeypatch.setattr(runtime, "_wait_until", wait)
    try:
        with flash.threads(2):
            runtime.run(list(range(30)), fn)
    except BaseException as e:  # noqa: BLE001 - returned to the test
        return e, sorted(ran)
    return None, sorted(ran)


def test_an_error_stops_the_workers_for_good(monkeypatch):
    """An error in the caller's task cancels the job: the worker still in its task takes
    no other task after it, and the error is raised."""
    err, ran = _error_path_run(monkeypatch, caller_raises=True, interrupt=False)
    assert isinstance(err, KeyError) and ran == [0, 1]


def test_an_interrupt_while_waiting_keeps_the_job_cancelled(monkeypatch):
    err, ran = _error_path_run(monkeypatch, caller_raises=True, interrupt=True)
    assert isinstance(err, KeyError) and ran == [0, 1]                 # the first error wins


def test_an_interrupt_while_waiting_is_raised_after_the_workers_left(monkeypatch):
    """Ctrl-C while the caller waits for a worker's last task: the call waits for it to
    leave, then raises KeyboardInterrupt (every task ran once)."""
    err, ran = _error_path_run(monkeypatch, caller_raises=False, interrupt=True)
    assert isinstance(err, KeyboardInterrupt) and ran == list(range(30))


def test_a_worker_that_cannot_start_fails_the_call(monkeypatch):
    """The pool failing to start a thread is raised from the call, not swallowed."""
    if runtime.blas_controller() is None:
        pytest.skip("without threadpoolctl the tiles run on the calling thread")
    use_pool(monkeypatch)

    def grow(n):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(runtime._pool, "grow", grow)
    with flash.threads(2), pytest.raises(RuntimeError, match="can't start new thread"):
        runtime.run([0, 1, 2], lambda t: None)


def test_the_blas_limit_of_a_call_that_died_is_released():
    """A token that dies without its exit (a call killed mid-way) is dropped by the BLAS
    thread's periodic wake-up and the limit restored."""
    ctl = FakeController()
    b = runtime._Blas()
    b.controller = ctl
    tok = runtime._Token()
    assert b.request("enter", tok) is None and ctl.log == [("limit", 1, "blas")]
    del tok
    for _ in range(200):
        if "restore" in ctl.log:
            break
        time.sleep(0.05)
    assert ctl.log == [("limit", 1, "blas"), "restore"] and b.limiter is None


def test_a_request_returns_only_once_the_blas_thread_did_it():
    """exit returns after BLAS is restored (not on the previous command's acknowledgement)."""
    ctl = FakeController()
    gate = threading.Event()

    class SlowLimiter(FakeLimiter):
        def restore_original_limits(self):
            assert gate.wait(20)
            super().restore_original_limits()

    ctl.limit = lambda limits, user_api: ctl.log.append("limit") or SlowLimiter(ctl.log)
    b = runtime._Blas()
    b.controller = ctl
    tok = runtime._Token()
    assert b.request("enter", tok) is None
    threading.Timer(0.1, gate.set).start()
    assert b.request("exit", tok) is None
    assert ctl.log == ["limit", "restore"]


def test_without_threadpoolctl_the_controller_is_none(monkeypatch):
    """threadpoolctl not importable: blas_controller() is None (looked up once), and the
    BLAS block is a no-op."""
    monkeypatch.setattr(runtime, "_blas", runtime._Blas())
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)
    assert runtime.blas_controller() is None and runtime._blas.controller is None
    with runtime.blas_single_threaded():
        assert runtime._blas.thread is None


# ---- torch's OpenMP team -------------------------------------------------------------------
def team_or_skip():
    pytest.importorskip("torch")
    if runtime.blas_controller() is None or runtime._omp_team(2) is None:
        pytest.skip("torch's OpenMP runtime is not GNU libgomp here (or no threadpoolctl)")


def test_tasks_run_on_torch_openmp_team_beside_the_caller(monkeypatch):
    """Where torch's OpenMP runtime is libgomp, n tasks (n up to torch's thread count)
    that each wait for all n to be running complete on the caller and n − 1 of
    libgomp's threads; the pool starts no worker, and the parallel region is closed
    afterwards."""
    team_or_skip()
    monkeypatch.setattr(runtime, "_pool", runtime._Pool())
    main = threading.get_ident()
    for n in range(2, sys.modules["torch"].get_num_threads() + 1):
        barrier = threading.Barrier(n, timeout=20)
        seen = []

        def fn(t, seen=seen, barrier=barrier):
            seen.append(threading.get_ident())
            barrier.wait()

        with flash.threads(n):
            runtime.run(list(range(n)), fn)
        assert len(set(seen)) == n and main in seen
        assert not runtime._pool.workers
        assert runtime._omp[0].omp_get_level() == 0


def test_team_threads_keep_their_python_thread_state_between_jobs():
    """ctypes makes and deletes a Python thread state around each callback of a thread
    that has none (25 of the 57 µs of an empty job): a team thread keeps the one made
    on its first job, so what it stored in a thread-local in one job is there in the
    next (with a fresh state each time it was gone)."""
    team_or_skip()
    main = threading.get_ident()
    local, seen = threading.local(), []
    barrier = threading.Barrier(2, timeout=20)

    def fn(t):
        barrier.wait()
        if threading.get_ident() != main:
            seen.append(getattr(local, "jobs", 0))
            local.jobs = getattr(local, "jobs", 0) + 1

    with flash.threads(2):
        for _ in range(3):
            runtime.run([0, 1], fn)
    assert len(seen) == 3 and seen[1:] == [seen[0] + 1, seen[0] + 2]


def test_a_nested_call_on_a_team_thread_runs_inline():
    team_or_skip()
    main = threading.get_ident()
    barrier = threading.Barrier(2, timeout=20)
    nested, levels = [], []

    def outer(t):
        barrier.wait()
        if threading.get_ident() != main:
            levels.append(runtime._omp[0].omp_get_level())
            runtime.run(list(range(6)), lambda i: nested.append(threading.get_ident()))

    with flash.threads(2):
        runtime.run([0, 1], outer)
    assert levels == [1] and len(nested) == 6 and len(set(nested)) == 1 and nested[0] != main


TEAM_FORK = r"""
import multiprocessing as mp, os, sys
import numpy as np
import torch
x = torch.randn(1 << 21)
float((x * 2).sum())                                   # torch's OpenMP team ran in the parent

def work(_):
    import attnkit
    from attnkit import flash
    from attnkit.flash import runtime
    from attnkit.testing import make_qkv
    q, k, v = make_qkv((2, 4, 300, 16), (2, 2, 300, 16), dtype="float32", seed=1)
    with flash.threads(2):
        out = attnkit.attention(q, k, v, causal=True, backend="flash")
    return float(out.sum()), runtime._omp_team(2) is None

if sys.argv[1] == "late":                              # a bare fork; the child gives torch one thread, then
    pid = os.fork()                                    # imports attnkit (torch's own ops work there)
    if pid == 0:
        torch.set_num_threads(1)
        float((x * 2).sum())
        os._exit(0 if work(0)[1] else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    print("ok")
    sys.exit(0)
if sys.argv[1] == "imported":                          # attnkit imported and on the team before the fork
    import attnkit
    from attnkit.flash import runtime
    want, off = work(0)
    assert not off, "the parent should run on torch's team"
else:                                                  # imported only in the children
    want = None
with mp.get_context("fork").Pool(2) as pool:
    got = pool.map(work, range(4))
assert all(off for _, off in got), got
assert want is None or all(g == want for g, _ in got), (got, want)
if sys.argv[1] == "imported":
    pid = os.fork()
    if pid == 0:
        os._exit(0 if work(0) == (want, True) else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
print("ok")
"""


@pytest.mark.parametrize("when", ["imported", "in the children", "late"])
def test_fork_children_never_join_the_team(when):
    """After torch's OpenMP team ran in the parent, fork children (multiprocessing's fork
    pool, a bare os.fork; attnkit imported before the fork, in multiprocessing's
    children, or in a bare child that gave torch one thread) compute on attnkit's own
    pool: libgomp's threads stayed in the parent, and its next parallel region there
    would wait for them forever."""
    team_or_skip()
    r = subprocess.run([sys.executable, "-c", TEAM_FORK, when.split()[0]], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


@pytest.mark.parametrize("entry", ["one native pass", "passes of Python"])
def test_interrupt_storm_on_the_team_leaves_it_closed(entry):
    """The interrupt storm with torch loaded: the calls run on the team (the compiled
    loop's native entry, or Python's passes where a call is too large for it), and
    afterwards the bits, BLAS's thread count and libgomp's level (no region left open)
    are intact."""
    team_or_skip()
    if entry == "one native pass":
        spy = ("team, joined = runtime._omp_team(2), []\n"              # regions opened (interrupts land after)
               "region = team.GOMP_parallel\n"
               "team.GOMP_parallel = lambda *a: (joined.append(1), region(*a))[1]\n")
    else:
        spy = ("member, joined = runtime._team_member, []\n"
               "runtime._team_member = lambda job: (joined.append(1), member(job))\n"
               "import attnkit.flash.forward\nattnkit.flash.forward.NATIVE_WORK = -1\n")
    script = STORM.replace("import attnkit\n", "import torch\nimport attnkit\nfrom attnkit.flash import runtime\n"
                           + spy, 1)
    script = script.replace('print("ok", hits, calls)', 'assert len(joined) > 20, len(joined)\n'
                            'assert runtime._omp_team(2).omp_get_level() == 0\nprint("ok", hits, calls)')
    assert "import torch" in script and "assert len(joined)" in script   # both replacements made
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("ok"), (r.stdout, r.stderr[-3000:])
    assert int(r.stdout.split()[1]) > 20


def test_the_team_is_off_in_another_process_and_without_gnu_libgomp(monkeypatch):
    """No team in a process other than the one that imported attnkit (a fork child),
    nor where threadpoolctl finds no GNU libgomp or fails to look."""
    team_or_skip()
    monkeypatch.setattr(attnkit, "_PID", -1)
    assert runtime._omp_team(2) is None
    monkeypatch.undo()
    assert runtime._omp_team(2) is not None
    threadpoolctl = pytest.importorskip("threadpoolctl")

    class Intel:
        internal_api, prefix, filepath = "openmp", "libiomp", "/nowhere/libiomp5.so"

    class Found:
        lib_controllers = [Intel()]

    monkeypatch.setattr(threadpoolctl, "ThreadpoolController", Found)
    assert runtime._find_libgomp(sys.modules['torch']) is None

    def broken():
        raise OSError("cannot read /proc/self/maps")

    monkeypatch.setattr(threadpoolctl, "ThreadpoolController", broken)
    assert runtime._find_libgomp(sys.modules['torch']) is None


def test_the_team_is_never_larger_than_torchs(monkeypatch):
    """More threads than torch runs take the pool (libgomp ends the process when it
    cannot start a thread); as many take the team."""
    team_or_skip()
    torch = pytest.importorskip("torch")
    n = torch.get_num_threads()
    assert runtime._omp_team(n) is not None and runtime._omp_team(n + 1) is None
    monkeypatch.setattr(runtime, "_pool", runtime._Pool())
    joined = []
    monkeypatch.setattr(runtime, "_team_member", lambda job: joined.append(1))
    with flash.threads(n + 1):
        runtime.run(list(range(n + 1)), lambda t: time.sleep(0.01))
    assert not joined and len(runtime._pool.workers) == n


def after_the_region_opens(monkeypatch, then):
    """runtime's libgomp, calling ``then()`` right after each region opens; returns the
    real one."""
    lib = runtime._omp[0]

    class Opened:
        def __getattr__(self, name):
            return getattr(lib, name)

        def GOMP_parallel_start(self, *args):
            lib.GOMP_parallel_start(*args)
            then()

    monkeypatch.setattr(runtime, "_omp", [Opened()])
    return lib


def test_an_interrupt_while_the_region_is_open_is_raised_after_it_closed(monkeypatch):
    """Ctrl-C landing right after the region opened (before the caller's share starts)
    cancels the job and is raised once the region is closed: libgomp's level is back
    to 0, SIGINT has its handler back, and the next call runs on the team again."""
    team_or_skip()
    import _thread
    import signal
    # Python's own handler, even where the process was started with SIGINT ignored (a
    # shell's background job: interrupt_main then does nothing), put back afterwards
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupt_in_region(monkeypatch, _thread, signal)
    finally:
        signal.signal(signal.SIGINT, old)


def _interrupt_in_region(monkeypatch, _thread, signal):
    before = signal.getsignal(signal.SIGINT)
    lib = after_the_region_opens(monkeypatch, _thread.interrupt_main)   # raised at the next bytecode boundary
    ran = []
    with flash.threads(2), pytest.raises(KeyboardInterrupt):
        runtime.run(list(range(40)), lambda t: (time.sleep(0.005), ran.append(t)))
    assert lib.omp_get_level() == 0 and len(ran) < 40
    assert signal.getsignal(signal.SIGINT) is before
    monkeypatch.setattr(runtime, "_omp", [lib])
    seen = []
    barrier = threading.Barrier(2, timeout=20)
    with flash.threads(2):
        runtime.run([0, 1], lambda t: (seen.append(threading.get_ident()), barrier.wait()))
    assert len(set(seen)) == 2 and lib.omp_get_level() == 0


def test_torchs_own_libgomp_is_preferred(monkeypatch):
    """With two GNU libgomp copies loaded, the one in torch's directory is the team."""
    team_or_skip()
    torch = pytest.importorskip("torch")
    threadpoolctl = pytest.importorskip("threadpoolctl")
    import os

    class Gomp:
        internal_api, prefix = "openmp", "libgomp"

        def __init__(self, path):
            self.filepath = path

    class Found:
        lib_controllers = [Gomp("/usr/lib/x86_64-linux-gnu/libgomp.so.1"),
                           Gomp(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1"))]

    class Lib:
        def __init__(self, path):
            self.path = path
            for name in ("GOMP_parallel", "GOMP_parallel_start", "GOMP_parallel_end", "omp_get_level"):
                setattr(self, name, type("Fn", (), {})())

    monkeypatch.setattr(threadpoolctl, "ThreadpoolController", Found)
    monkeypatch.setattr(runtime.ctypes, "CDLL", Lib)
    assert runtime._find_libgomp(torch).path == Found.lib_controllers[1].filepath


def test_an_interrupt_to_a_handler_that_returns_lets_every_task_run(monkeypatch):
    """With a SIGINT handler of the user's that does not raise, an interrupt while the
    region is open cancels nothing (every task runs: no partial result comes back
    as if whole) and reaches that handler once, at once (inside the region)."""
    team_or_skip()
    import _thread
    import signal
    lib = runtime._omp[0]
    calls = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(lib.omp_get_level()))
    try:
        ran = []

        def fn(t):
            if t == 2:
                _thread.interrupt_main()
            time.sleep(0.003)
            ran.append(t)

        with flash.threads(2):
            runtime.run(list(range(30)), fn)
    finally:
        signal.signal(signal.SIGINT, old)
    assert sorted(ran) == list(range(30)) and calls == [1] and lib.omp_get_level() == 0


def test_any_exception_right_after_the_region_opened_still_closes_it(monkeypatch):
    """An exception from another signal's handler (a timeout) landing right after the
    region opened: the team finishes its task in hand, the region is closed, SIGINT
    has its handler back, and the exception is raised."""
    team_or_skip()
    import signal
    before = signal.getsignal(signal.SIGINT)

    def alarm():
        raise TimeoutError("alarm")

    lib = after_the_region_opens(monkeypatch, alarm)
    with flash.threads(2), pytest.raises(TimeoutError, match="alarm"):
        runtime.run(list(range(20)), lambda t: time.sleep(0.005))
    assert lib.omp_get_level() == 0 and signal.getsignal(signal.SIGINT) is before


def test_every_interrupt_reaches_a_handler_that_returns(monkeypatch):
    """Two Ctrl-C during one call reach the user's handler twice, each at once."""
    team_or_skip()
    import _thread
    import signal
    calls = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    try:
        def fn(t):
            if t in (1, 5):
                _thread.interrupt_main()
            time.sleep(0.003)

        with flash.threads(2):
            runtime.run(list(range(12)), fn)
    finally:
        signal.signal(signal.SIGINT, old)
    assert calls == [signal.SIGINT, signal.SIGINT]


def test_the_native_entry_is_refused_where_the_team_cannot_take_it(monkeypatch):
    """runtime.run_native runs nothing and says so (False: the caller runs its passes)
    for one thread, inside a worker (a nested call runs inline), and without
    threadpoolctl (no BLAS hold)."""
    opened = []

    class Team:
        def GOMP_parallel(self, *args):
            opened.append(args)

    monkeypatch.setattr(runtime, "_omp_team", lambda n: Team())
    monkeypatch.setattr(runtime, "blas_controller", lambda: object())
    monkeypatch.setattr(runtime, "blas_single_threaded", contextlib.nullcontext)
    data = 1234                                       # the arguments' address
    assert runtime.run_native(7, data, 2) and opened == [(7, data, 2, 0)]
    opened.clear()
    assert not runtime.run_native(7, data, 1)
    monkeypatch.setattr(runtime._local, "worker", True, raising=False)
    assert not runtime.run_native(7, data, 2)
    monkeypatch.setattr(runtime._local, "worker", False)
    monkeypatch.setattr(runtime, "blas_controller", lambda: None)
    assert not runtime.run_native(7, data, 2)
    assert not opened
