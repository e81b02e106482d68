"""The flash rung's runtime: worker threads, BLAS held to one thread while tiles run,
and safety under fork and KeyboardInterrupt.

Threads: :func:`run` executes a call's tasks on the calling thread plus up to
``get_threads() − 1`` pool workers (:func:`threads`, else :func:`set_threads`, else the
usable cores), which take tasks in order from a shared counter and sleep on a queue
between calls; results never depend on their number (each output element is reduced
by one task in a fixed order). Where torch is loaded with GNU libgomp, the tasks run
on the calling thread's libgomp team instead, whose threads spin for milliseconds
after each of torch's ops (a Llama layer's attention beside them took twice as long
inside the model as alone); compiled entries run there with no Python
(:func:`run_native`, :func:`native_team`). Never in a fork or multiprocessing child
(libgomp would wait for the parent's threads forever), nor with more threads than
torch runs (libgomp ends the process when it cannot start one). Ctrl-C while the
region is open cancels the job and is raised once the region is closed (:func:`_on_team`).

BLAS: while a call's tiles may multiply on several BLAS threads, NumPy's BLAS is held
to one thread per worker. threadpoolctl's limit is process-wide, so overlapping calls
share it: one dedicated thread applies it when the first call enters and restores it
when the last leaves (OpenMP libraries keep it per thread); one OpenBLAS threaded by
pthreads (NumPy's wheels) is set by the calls themselves (:meth:`_Blas._inline`).
Without threadpoolctl the tiles run on the calling thread.

Interrupts and fork: no lock is held across a wait and no Condition is used; every
wait re-checks its state, so a KeyboardInterrupt anywhere lets the call stop its
workers (they finish the task in hand), restore BLAS and re-raise. After ``os.fork()``
the child starts with no workers and no BLAS limit: they are made again on first use.
"""

from __future__ import annotations

import _signal
import _thread
import contextlib
import contextvars
import ctypes
import itertools
import numbers
import os
import queue
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from types import SimpleNamespace
from typing import Any

from ..nonfinite import quiet

_UNSET: Any = object()
# The worker count: the context's setting (threads()), else the process default
# (set_threads), else the core count. A ContextVar, so that concurrent calls on other
# threads never see another thread's `with threads(n)`.
_threads_var: contextvars.ContextVar = contextvars.ContextVar("attnkit_flash_threads", default=_UNSET)
_default_threads: list[int | None] = [None]
_local = threading.local()            # .worker: True on pool threads (nested calls run inline)


def _core_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _check_threads(n: Any) -> int | None:
    if n is not None and (isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1):
        raise ValueError(f"threads: expected a positive int or None, got {n!r}")
    return None if n is None else int(n)


def get_threads() -> int:
    """Workers the rung uses in the current context: the :func:`threads` setting,
    else the process default of :func:`set_threads`, else the core count.

    >>> get_threads() >= 1
    True
    """
    n = _threads_var.get()
    return (_default_threads[0] if n is _UNSET else n) or _core_count()


def set_threads(n: int | None = None) -> int | None:
    """Set the process-wide default number of workers; returns the previous default.
    One worker runs every tile on the calling thread. A :func:`threads` block in
    effect in the current context takes precedence.

    Parameters
    ----------
    n : int or None
        Workers (any positive integer, NumPy integers included); None = the number of
        usable cores.

    Examples
    --------
    >>> old = set_threads(1); get_threads()
    1
    >>> _ = set_threads(old)
    """
    n = _check_threads(n)
    old, _default_threads[0] = _default_threads[0], n
    return old


@contextlib.contextmanager
def threads(n: int | None) -> Iterator[None]:
    """``with flash.threads(2): ...`` runs the block with n workers. The setting
    belongs to the current context (thread / task): calls running concurrently
    elsewhere keep their own.

    Parameters
    ----------
    n : int or None
        Workers inside the block; None = the number of usable cores.

    Examples
    --------
    >>> with threads(1):
    ...     get_threads()
    1
    """
    token = _threads_var.set(_check_threads(n))
    try:
        yield
    finally:
        _threads_var.reset(token)


def _wait_until(done: Callable[[], bool], lock: Any, on_interrupt: Callable[[], None]) -> BaseException | None:
    """Block until ``done()``, waking when ``lock`` is released (and every 50 ms: a lost
    wake-up costs little); a KeyboardInterrupt meanwhile calls ``on_interrupt`` and is
    returned once done() holds, for the caller to raise."""
    caught: BaseException | None = None
    while True:
        try:
            while not done():
                lock.acquire(timeout=0.05)
            return caught
        except KeyboardInterrupt as e:
            caught = caught or e
            while True:                      # a second interrupt here must not escape either
                try:
                    on_interrupt()
                    break
                except KeyboardInterrupt:
                    pass


def _release(lock: Any) -> None:
    with contextlib.suppress(RuntimeError):  # already released: a wake-up is pending anyway
        lock.release()


# ---- the worker pool -------------------------------------------------------------------
class _Job:
    """One call's tasks, claimed in order from a shared counter by the caller and the
    workers that join (``inside``: those in the job now)."""

    def __init__(self, fn: Callable[[Any], None], tasks: Sequence[Any]) -> None:
        self.fn, self.tasks = fn, tasks
        self.counter = itertools.count()
        self.errors: list[BaseException] = []
        self.inside: set[int] = set()
        self.cancel = False
        self.wake = _thread.allocate_lock()
        self.wake.acquire()
        self.callback: Any = None           # the ctypes callback of libgomp's threads, kept alive

    def work(self) -> None:
        """Run tasks until none is left or the job is cancelled."""
        n = len(self.tasks)
        while not self.cancel:
            i = next(self.counter)
            if i >= n:
                return
            try:
                with quiet():
                    self.fn(self.tasks[i])
            except BaseException as e:      # noqa: BLE001 — re-raised by the caller
                self.errors.append(e)
                self.cancel = True

    def join(self, me: int) -> None:
        """A worker's turn in the job (added to ``inside`` before it looks at cancel,
        so the caller never returns while it works)."""
        self.inside.add(me)
        try:
            self.work()
        finally:
            self.inside.discard(me)
            _release(self.wake)


class _Pool:
    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()   # put/get in C: no Python lock to break
        self.workers: list[threading.Thread] = []
        self.lock = threading.Lock()

    def grow(self, n: int) -> None:
        if len(self.workers) >= n:
            return
        _register_fork_hooks()
        with self.lock:
            while len(self.workers) < n:
                t = threading.Thread(target=self._loop, args=(self.jobs,), daemon=True,
                                     name=f"attnkit-flash-{len(self.workers)}")
                t.start()
                self.workers.append(t)

    @staticmethod
    def _loop(jobs: queue.SimpleQueue) -> None:
        _local.worker = True
        me = threading.get_ident()
        while True:
            job = jobs.get()
            job.join(me)
            del job


_pool = _Pool()


def run(tasks: Sequence[Any], fn: Callable[[Any], None], *, blas: bool = True) -> None:
    """fn(task) for every task: on the calling thread and up to get_threads() − 1 pool
    workers (or libgomp threads: torch's OpenMP team), with BLAS held to one thread; or
    on the calling thread alone (BLAS threading as it likes) without threadpoolctl.
    ``blas=False``: the tasks make no BLAS call that could use more than one thread, and
    BLAS is left alone (its hold's hand-offs cost 0.1–0.2 ms a call here). Re-raises the
    first error (or KeyboardInterrupt) after every worker has left the job."""
    n = min(get_threads(), len(tasks))
    hold = blas_single_threaded if blas else contextlib.nullcontext
    if blas_controller() is None or n <= 1 or getattr(_local, "worker", False):
        with hold(), quiet():
            for t in tasks:
                fn(t)
        return
    with hold():
        job = _Job(fn, tasks)
        team = _omp_team(n)
        if team is not None:
            _on_team(team, job, n)
        else:
            try:
                _pool.grow(n - 1)
                for _ in range(n - 1):
                    _pool.jobs.put(job)
                job.work()
            except BaseException as e:      # noqa: BLE001 — re-raised below
                job.errors.append(e)
                job.cancel = True
            finally:
                job.cancel = True            # every task is claimed or abandoned by now
                late = _wait_until(lambda: not job.inside, job.wake, lambda: setattr(job, "cancel", True))
            if late is not None:
                job.errors.append(late)
        if job.errors:
            raise job.errors[0]


def run_native(fn: int, data: int, n: int, *, blas: bool = True) -> bool:
    """The C function at address ``fn`` on the address ``data``, on the calling thread and
    n − 1 of torch's libgomp threads (no Python, no GIL), BLAS held to one thread unless
    ``blas=False``; False where the team cannot take it (:func:`run` then). Ctrl-C waits."""
    team = _native(n)
    if team is not None:
        with blas_single_threaded() if blas else contextlib.nullcontext():
            team.GOMP_parallel(fn, data, n, 0)
    return team is not None


def native_team(n: int) -> tuple[int, int]:
    """(libgomp's ``GOMP_parallel``'s address, m) for m ≤ n threads, at most torch's, as
    :func:`run_native` runs them, else (0, 0): for compiled code without BLAS to call."""
    m = min(n, sys.modules["torch"].get_num_threads()) if "torch" in sys.modules else n
    return (0, 0) if _native(m) is None else (_omp[1], m)


def _native(n: int) -> Any:                 # libgomp where run_native may open a region
    return None if n <= 1 or getattr(_local, "worker", False) or blas_controller() is None else _omp_team(n)


# ---- torch's OpenMP team -------------------------------------------------------------------
_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_omp: list[Any] = [_UNSET, 0]   # libgomp (ctypes) once torch is loaded, or None; its GOMP_parallel's address


def _team_member(job: _Job) -> None:
    """A libgomp thread's part of a job (nested calls inside its tasks run inline). A
    thread keeps its Python thread state for good (one PyGILState_Ensure never released):
    ctypes made and deleted one per callback, 25 of the 57 µs a job of no task cost."""
    if not getattr(_local, "kept", False):
        _local.kept = ctypes.pythonapi.PyGILState_Ensure() is not None
    _local.worker = True
    try:
        job.join(threading.get_ident())
    finally:
        _local.worker = False


def _omp_team(n: int) -> Any:
    """libgomp (ctypes) when n threads may run the tasks on torch's OpenMP team, else
    None: torch loaded with GNU libgomp as its OpenMP runtime, threadpoolctl present,
    this the process that imported attnkit (not a fork child) and not a
    multiprocessing child, and n at most torch's own thread count — a team torch also
    runs (libgomp ends the process when it cannot start a thread; and a fork child
    that gave torch one thread keeps its hands off the parent's team)."""
    if os.getpid() != sys.modules["attnkit"]._PID:     # (no import statement: called per call)
        return None
    torch = sys.modules.get("torch")
    if torch is None:
        return None                         # looked for again on the next call
    if _omp[0] is _UNSET:
        found = _find_libgomp(torch)         # (the address kept: a ctypes cast costs a call 9 µs cold)
        _omp[:] = [found, 0 if found is None else int(ctypes.cast(found.GOMP_parallel, ctypes.c_void_p).value or 0)]
    if _omp[0] is None or n > torch.get_num_threads():
        return None
    return _omp[0]


def _on_team(team: Any, job: _Job, n: int) -> None:
    """The job on the calling thread and n − 1 of libgomp's threads: a parallel region
    opened and closed around the caller's share; task errors go to ``job.errors``. The
    region must be closed whatever happens: left open, every later region of the thread
    (torch's included) runs single-threaded and the team's threads wait at its barrier
    for good. Python may raise a signal handler's exception at almost any bytecode
    boundary, so the close is retried through any exception, kept with the call's
    errors. On the main thread, SIGINT's handler meanwhile is :func:`_holder`'s: the
    original handler runs at once; what it raises (KeyboardInterrupt) cancels the job
    and is raised when the region is closed."""
    level = team.omp_get_level()
    main = threading.current_thread() is threading.main_thread()
    handler = _signal.getsignal(_signal.SIGINT) if main else None   # _signal: no enum conversions
    hold = _holder(job, handler) if callable(handler) else None
    try:
        if hold is not None:
            _signal.signal(_signal.SIGINT, hold)
        job.callback = _CALLBACK(lambda _: _team_member(job))
        team.GOMP_parallel_start(job.callback, None, n)
        job.work()
    finally:
        job.cancel = True                    # every task is claimed or abandoned by now
        while True:
            try:
                while team.omp_get_level() > level:
                    team.GOMP_parallel_end()     # waits in C for the team's threads to leave
                job.callback = None              # only once no thread of the team can call it
                if hold is not None and _signal.getsignal(_signal.SIGINT) is hold:
                    _signal.signal(_signal.SIGINT, handler)
                break
            except BaseException as e:           # noqa: BLE001 — raised by run with the others
                job.errors.append(e)


def _holder(job: _Job, handler: Callable[[Any, Any], Any]) -> Callable[[Any, Any], None]:
    """SIGINT's handler while a job's region is open: ``handler`` (the original) runs
    at once; an exception it raises cancels the job and joins its errors, raised once
    the region is closed. A handler that returns cancels nothing (every task runs)."""
    def hold(signum: Any, frame: Any) -> None:
        try:
            handler(signum, frame)
        except BaseException as e:           # noqa: BLE001 — raised by run once the region is closed
            job.errors.append(e)
            job.cancel = True

    return hold


def _find_libgomp(torch: Any) -> Any:
    import multiprocessing
    if (multiprocessing.parent_process() is not None or blas_controller() is None
            or not hasattr(torch, "get_num_threads")):
        return None
    from threadpoolctl import ThreadpoolController
    try:
        paths = [c.filepath for c in ThreadpoolController().lib_controllers
                 if c.internal_api == "openmp" and c.prefix == "libgomp"]
    except Exception:                       # noqa: BLE001 — no team then, the pool works
        return None
    if not paths:
        return None
    home = os.path.dirname(getattr(torch, "__file__", None) or "") + os.sep
    paths.sort(key=lambda p: not p.startswith(home))   # torch's own copy first, where there are two
    try:
        lib = ctypes.CDLL(paths[0])
        void, uint = ctypes.c_void_p, ctypes.c_uint         # omp_get_level: regions open, 0 outside any
        for name, args, result in (("GOMP_parallel", [void, void, uint, uint], None),
                                   ("GOMP_parallel_start", [_CALLBACK, void, uint], None),
                                   ("GOMP_parallel_end", [], None), ("omp_get_level", [], ctypes.c_int)):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, result
    except (OSError, AttributeError):       # not the GNU runtime's symbols after all
        return None
    return lib


# ---- BLAS held to one thread -------------------------------------------------------------
class _Token:
    """One call's hold on the BLAS limit (weakly referenced: dying, it releases it)."""

    def __init__(self) -> None:
        self.acked = False
        self.error: Exception | None = None  # threadpoolctl's, handed to the call
        self.lock = _thread.allocate_lock()
        self.lock.acquire()


class _Blas:
    """The thread that sets and restores the BLAS limit and its bookkeeping; or, for
    one pthreads OpenBLAS (NumPy's wheels), the calls themselves (:meth:`_inline`)."""

    def __init__(self) -> None:
        self.cmds: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()
        self.controller: Any = _UNSET
        self.limiter: Any = None
        self.direct: Any = _UNSET           # the one pthreads OpenBLAS's get/set functions, or None
        self.held: dict[int, weakref.ref] = {}   # the inline path's calls inside (their tokens)
        self.saved, self.restoring = 0, False    # the count before them; a restore not yet done

    def start(self) -> None:
        if self.thread is None:
            _register_fork_hooks()
            with self.lock:
                if self.thread is None:
                    self.thread = threading.Thread(target=self._loop, daemon=True, name="attnkit-blas")
                    self.thread.start()

    def _loop(self) -> None:
        active: dict[int, weakref.ref] = {}
        while True:
            try:
                cmd, ref = self.cmds.get(timeout=0.2) if active else self.cmds.get()
            except queue.Empty:
                cmd, ref = None, None
            tok = None if ref is None else ref()
            if cmd == "enter" and tok is not None:
                active[id(tok)] = ref
            elif cmd == "exit" and tok is not None:
                active.pop(id(tok), None)
            for key in [key for key, r in active.items() if r() is None]:   # calls that died
                del active[key]
            try:
                if active and self.limiter is None:
                    self.limiter = self.controller.limit(limits=1, user_api="blas")
                elif not active and self.limiter is not None:
                    limiter, self.limiter = self.limiter, None
                    limiter.restore_original_limits()
            except Exception as e:           # noqa: BLE001 — raised by the call; this thread lives on
                if tok is not None:
                    tok.error = e
            finally:
                if tok is not None:
                    tok.acked = True
                    _release(tok.lock)
            del tok

    def request(self, cmd: str, tok: _Token) -> BaseException | None:
        """Send ``cmd`` and wait for it: returns a KeyboardInterrupt caught meanwhile, or
        threadpoolctl's error (as a RuntimeError naming what failed)."""
        self.direct = _one_pthreads_openblas(self.controller) if self.direct is _UNSET else self.direct
        if self.direct is not None:
            _register_fork_hooks()
            return self._inline(cmd, tok)
        tok.acked = False
        self.start()
        self.cmds.put((cmd, weakref.ref(tok)))
        late = _wait_until(lambda: tok.acked, tok.lock, lambda: None)
        if late is None and tok.error is not None:
            e, tok.error = tok.error, None
            what = "hold BLAS to one thread" if cmd == "enter" else "restore BLAS's thread count"
            late = RuntimeError(f"attnkit could not {what} (threadpoolctl: {type(e).__name__}: {e})")
            late.__cause__ = e
        return late

    def _inline(self, cmd: str, tok: _Token) -> BaseException | None:
        """``cmd`` on the calling thread (a pthreads OpenBLAS: any thread may set its one
        count), counted under the lock: no hand-off to the BLAS thread (0.1 ms a call).
        Dead calls' tokens are dropped (restoring if they were the last); ``restoring`` is
        set before the last call leaves: a cut-short restore is finished next."""
        lib = self.direct
        try:
            with self.lock:
                dead = [key for key, r in self.held.items() if r() is None]
                for key in dead:
                    del self.held[key]
                self.restoring = self.restoring or bool(dead and not self.held)   # they held the limit
                if cmd == "enter":
                    if not self.held and not self.restoring:
                        self.saved = lib.get_num_threads()
                    self.held[id(tok)] = weakref.ref(tok)
                elif id(tok) in self.held:           # restoring is set before the last one leaves
                    self.restoring = len(self.held) == 1 or self.restoring
                    del self.held[id(tok)]
                if self.restoring:
                    lib.set_num_threads(self.saved)
                    self.restoring = False
                if self.held:
                    lib.set_num_threads(1)
        except Exception as e:               # noqa: BLE001 — handed to the call, named
            what = "hold BLAS to one thread" if cmd == "enter" else "restore BLAS's thread count"
            late = RuntimeError(f"attnkit could not {what} ({type(e).__name__}: {e})")
            late.__cause__ = e
            return late
        return None


def _one_pthreads_openblas(controller: Any) -> Any:
    """The thread-count functions (get, set) of the process's BLAS when that is one
    OpenBLAS threaded by pthreads (NumPy's wheels), else None. Its own C functions
    (threadpoolctl's wrapper lets only the first thread that sets a limit set one)."""
    libs = [c for c in getattr(controller, "lib_controllers", ()) if c.user_api == "blas"]
    if len(libs) != 1 or libs[0].internal_api != "openblas" or getattr(libs[0], "threading_layer", "") != "pthreads":
        return None
    try:
        lib = ctypes.CDLL(libs[0].filepath)
    except OSError:
        return None
    for prefix, suffix in itertools.product(("", "scipy_"), ("", "64_")):
        get = getattr(lib, f"{prefix}openblas_get_num_threads{suffix}", None)
        put = getattr(lib, f"{prefix}openblas_set_num_threads{suffix}", None)
        if get is not None and put is not None:
            get.argtypes, get.restype, put.argtypes, put.restype = [], ctypes.c_int, [ctypes.c_int], None
            return SimpleNamespace(get_num_threads=get, set_num_threads=put)
    return None


_blas = _Blas()


def blas_controller() -> Any:
    """A cached threadpoolctl controller, or None when threadpoolctl is missing."""
    if _blas.controller is _UNSET:
        with _blas.lock:
            if _blas.controller is _UNSET:
                try:
                    from threadpoolctl import ThreadpoolController
                except ImportError:
                    _blas.controller = None
                else:
                    _blas.controller = ThreadpoolController()
    return _blas.controller


@contextlib.contextmanager
def blas_single_threaded() -> Iterator[None]:
    """BLAS held to one thread inside the block (shared and reference counted across
    overlapping calls; restored when the last one leaves, even after an interrupt)."""
    if blas_controller() is None:
        yield
        return
    tok = _Token()
    try:
        if (late := _blas.request("enter", tok)) is not None:
            raise late
        yield
    finally:
        pending = None
        while True:                          # interrupted inside the inline exit: again, then raised
            try:
                late = _blas.request("exit", tok)
                break
            except BaseException as e:       # noqa: BLE001 — raised below
                pending = pending or e
        if pending is not None or late is not None:
            raise pending or late              # type: ignore[misc]


# ---- fork ---------------------------------------------------------------------------------
def _before_fork() -> None:
    _pool.lock.acquire()
    _blas.lock.acquire()


def _after_fork_in_parent() -> None:
    _blas.lock.release()
    _pool.lock.release()


def _after_fork_in_child() -> None:
    """A child has only the forking thread: no workers, and no parent call's BLAS limit."""
    global _pool, _blas
    parent = _blas
    _pool = _Pool()
    _blas = _Blas()
    _blas.controller, _blas.direct = parent.controller, parent.direct
    with contextlib.suppress(Exception):    # a best effort in a fresh child
        if parent.limiter is not None:
            parent.limiter.restore_original_limits()
        if parent.held or parent.restoring:
            parent.direct.set_num_threads(parent.saved)


_fork_hooks: list[bool] = []


def _register_fork_hooks() -> None:
    """Registered with the first worker or BLAS thread (nothing to undo before)."""
    if not _fork_hooks and hasattr(os, "register_at_fork"):
        _fork_hooks.append(True)
        os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                            after_in_child=_after_fork_in_child)
