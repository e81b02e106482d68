#!/usr/bin/env python3
"""Mutation testing for attnkit: do the tests catch wrong code?

A self-contained, AST-based mutation tool (no services, no extra packages). For each
target module it makes realistic single-site mutants — the bugs a person writes:

    compare   ``<``↔``<=``, ``>``↔``>=``, ``==``↔``!=``, ``is``↔``is not``, ``in``↔``not in``
    arith     ``+``↔``-``, ``*``↔``/`` (not on string, tuple or list literals); ``&``↔``|``,
              ``^``→``|``, ``<<``↔``>>``; the same for augmented assignments (``+=``↔``-=``)
    cond      an ``if`` / ``while`` / conditional-expression / comprehension test negated
    not       a ``not`` or ``~`` dropped
    neg       a unary minus dropped (``-np.inf`` → ``np.inf`` among them)
    inf       ``np.inf`` / ``float("inf")`` negated
    bool      ``True``↔``False``
    int       an integer constant ±1 (0 → 1)
    boolop    ``and``↔``or``
    minmax    ``min``↔``max`` (builtins, ``np.minimum``/``np.maximum``, ``.min()``/``.max()``)
    del       a statement removed inside a function: an assignment, an augmented
              assignment or a call statement (replaced by ``pass``)

Not mutated: docstrings, strings and f-strings (messages), type annotations, ``assert``
and ``raise`` statements (the conditions above a ``raise`` are), and the statements
at module or class level (a removed one fails at import: trivially killed).

Each mutant is applied to a private copy of the repository (``--work``, default
/tmp/mutwork; one copy per job): the main tree is never written to. pytest runs from
the copy with ``PYTHONPATH=<copy>/src`` ahead of the editable install, using this
interpreter (the repo's .venv); a self-check proves that the copy is what gets
imported and that a deliberate mutant there fails the tests. A baseline run of every
mapped test file records, per test, which lines of the targets it executes (a small
settrace plugin) and which tests fail on the unmutated code (those are deselected).
A mutant then runs first the tests that execute its line (fastest first, ``-x``),
and, if those pass, the whole mapped test set of its module — only a mutant that
passes all of them survives. A mutant whose line no test executes in-process runs
the whole set directly. A timeout (a hang) or a crash at import counts as killed.

Survivors are printed with file:line, the mutation and the mutated line. Mutants
judged equivalent (they cannot change any observable result) are listed in
``EQUIVALENT`` below, each with a one-line reason; the kill rate is
killed / (run − equivalent). Results go to a JSON file (``--json``) so that a rerun
can take only the previous survivors (``--survivors-of``).

Usage (slow: not run by CI; docs/mutation.md has the latest results)::

    .venv/bin/python scripts/mutation.py                       # every target, every mutant
    .venv/bin/python scripts/mutation.py spec/geometry.py merge.py --max 40 --seed 1
    .venv/bin/python scripts/mutation.py --list spec/core.py   # print the mutants, run nothing
    .venv/bin/python scripts/mutation.py --survivors-of out/mutation.json   # rerun survivors
    .venv/bin/python scripts/mutation.py --jobs 2 --json out/mutation.json

Targets are paths under src/attnkit (``TARGETS`` maps each to its test files).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import io
import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import tokenize
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = Path("src/attnkit")

# target module (under src/attnkit) -> the test files that exercise it, likeliest
# killers first. Its own doctests run too when it has any.
_FLASH_TESTS = ["tests/flash/test_flash.py", "tests/flash/test_kernels.py", "tests/flash/test_varlen.py",
                "tests/flash/test_loop.py", "tests/flash/test_backward_loop.py", "tests/test_kvcache.py",
                "tests/test_nonfinite.py"]
_EXPLAIN = ["tests/explain/test_trace.py", "tests/explain/test_text.py"]   # the reference's trace, shown
TARGETS: dict[str, list[str]] = {
    "spec/validate.py": ["tests/test_kept.py",
                         "tests/spec/test_validate.py", "tests/test_api.py", "tests/flash/test_varlen.py",
                         "tests/test_kvcache.py", "tests/spec/test_options.py", "tests/test_reference.py",
                         "tests/torch/test_op.py", "tests/torch/test_terms.py", "tests/test_backends.py"] + _EXPLAIN,
    "spec/geometry.py": ["tests/spec/test_geometry.py", "tests/test_reference.py", "tests/flash/test_flash.py",
                         "tests/flash/test_varlen.py", "tests/test_kvcache.py", "tests/test_nonfinite.py",
                         "tests/test_api.py"] + _EXPLAIN,
    "spec/core.py": ["tests/test_reference.py", "tests/test_api.py", "tests/spec/test_validate.py",
                     "tests/spec/test_geometry.py", "tests/flash/test_flash.py", "tests/flash/test_varlen.py",
                     "tests/torch/test_op.py", "tests/torch/test_out_layout.py", "tests/test_backends.py"] + _EXPLAIN,
    "spec/checks.py": ["tests/spec/test_checks.py", "tests/spec/test_validate.py",
                       "tests/test_api.py", "tests/test_merge.py",
                       "tests/torch/test_mha.py", "tests/torch/test_op.py"],
    "spec/options.py": ["tests/spec/test_options.py", "tests/test_api.py", "tests/spec/test_validate.py",
                        "tests/test_kvcache.py"],
    "spec/kvcache.py": ["tests/test_kvcache.py", "tests/test_kvcache_ragged.py", "tests/test_kvcache_cases.py",
                        "tests/torch/test_op.py"],
    "reference.py": ["tests/test_reference.py", "tests/test_nonfinite.py", "tests/test_api.py",
                     "tests/flash/test_varlen.py", "tests/test_kvcache.py", "tests/torch/test_terms.py"] + _EXPLAIN,
    "flash/plan.py": _FLASH_TESTS + ["tests/flash/test_plan.py", "tests/flash/test_runtime.py",
                                     "tests/spec/test_geometry.py"],
    "flash/forward.py": _FLASH_TESTS + ["tests/flash/test_forward_edges.py", "tests/spec/test_geometry.py"],
    "flash/backward.py": _FLASH_TESTS + ["tests/torch/test_terms.py", "tests/spec/test_geometry.py"],
    "flash/kernels.py": ["tests/flash/test_kernels.py"] + [t for t in _FLASH_TESTS if "kernels" not in t],
    "flash/runtime.py": ["tests/flash/test_runtime.py", "tests/flash/test_flash.py"],
    "flash/blas.py": ["tests/flash/test_loop.py"],
    "flash/numba_loop.py": ["tests/flash/test_loop.py", "tests/torch/test_out_layout.py"]
    + [t for t in _FLASH_TESTS if "loop" not in t],
    "flash/numba_small.py": ["tests/test_small.py", "tests/torch/test_out_layout.py", "tests/test_kvcache.py"],
    "flash/numba_backward.py": ["tests/flash/test_backward_loop.py", "tests/test_nonfinite.py",
                                "tests/flash/test_flash.py"],
    "merge.py": ["tests/test_merge.py", "tests/test_kvcache.py", "tests/torch/test_op.py"],
    "nonfinite.py": ["tests/test_nonfinite.py", "tests/test_reference.py", "tests/flash/test_flash.py"],
    "philox.py": ["tests/test_philox.py", "tests/flash/test_flash.py", "tests/test_reference.py",
                  "tests/torch/test_terms.py", "tests/torch/test_seeds.py", "tests/torch/test_op.py"],
    "torch/op.py": ["tests/test_kept.py",
                    "tests/torch/test_op.py", "tests/torch/test_terms.py", "tests/torch/test_seeds.py",
                    "tests/torch/test_out_layout.py"],
    "small.py": ["tests/test_kept.py",
                 "tests/test_small.py", "tests/test_nonfinite.py", "tests/test_backends.py", "tests/test_api.py",
                 "tests/test_kvcache.py"],
    "backends.py": ["tests/test_kept.py",
                    "tests/test_backends.py", "tests/test_api.py", "tests/test_small.py"],
    "kvcache.py": ["tests/test_kvcache.py", "tests/test_kvcache_cases.py", "tests/test_kvcache_ragged.py",
                   "tests/test_examples.py", "tests/torch/test_op.py"],
    "api.py": ["tests/test_kept.py",
               "tests/test_api.py", "tests/test_kvcache.py", "tests/test_merge.py", "tests/test_backends.py",
               "tests/torch/test_op.py", "tests/spec/test_options.py"],
    "torch/mha.py": ["tests/torch/test_mha.py", "tests/torch/test_mha_cases.py", "tests/torch/test_op.py"],
    "hf.py": ["tests/test_hf.py", "tests/test_hf_cases.py"],
    "distributed/ring.py": ["tests/distributed/test_ring.py"],
    "distributed/layout.py": ["tests/distributed/test_ring.py", "tests/spec/test_geometry.py"],
}
# Tests that fail or flake on the unmutated tree whatever the mutant (another change in
# progress, timing): never run, so that they can neither kill nor save a mutant.
DESELECT = ["tests/torch/test_op.py::test_cpu_tensors_run_the_flash_rung_when_heads_are_large",
            "tests/flash/test_runtime.py::test_interrupt_storm_leaves_pool_locks_and_blas_intact"]

# Mutants judged equivalent: (module, the original line stripped, the mutation) ->
# why no observable result can change. Matched by line text, not number; where one
# line has two mutants of the same name, the mutation ends in " @<column>" (the
# character column of the replaced span, as --list shows it) to name one.
R_BLOCK = ("a tuning constant: the default tile sizes only change how rows and keys are cut into tiles "
           "(the order of sums), never a result beyond rounding")
R_KEPT = ("how many rows a call may have, or how many geometries, for the small rung's row bounds to be kept: "
          "memory and speed only (a test pins that they are kept for small calls and that the store is bounded)")
_SMALL_ROWS = "_BOUNDS_ROWS = 1 << 16     # rows of a call whose bounds are kept (two int64 arrays each)"
R_TRACED = ("while torch.compile traces, the stand-in keys and their lengths are only shape-checked (values "
            "are read by the eager call inside the op, which gets the user's arguments): any size or value here "
            "traces the same graph")
R_ONE_ROW = "one query row aligned bottom-right sees every key: causal changes nothing at L = 1"
R_2D_MASK = "the padding mask read here is 2-D (B, S): axis 1 is axis -1"
R_4D = "transformers hands its attention functions 4-D (B, H, L, D) queries and keys: axis 2 is axis -2"
R_PRETRAINED = ("the default is never read: _model_classes returns PreTrainedModel subclasses, and PreTrainedModel "
                "sets _supports_sdpa and _supports_attention_backend (False)")
# line texts of flash/plan.py's tuning constants (the keys below)
_PLAN_BWD = 'return (256, 256) if D <= 128 else (128, 256)'
_PLAN_FWD = 'return (1024, 512) if D <= 128 else (512, 512)'
_PLAN_SUB = 'SUB_M = 128            # row strips for the tiles that causal/window cut through'
_PLAN_DEC = 'DECODE_ROWS = 64       # units with at most this many rows stream their keys (decoding)'
_PLAN_SMALL = 'SMALL_TILE = 1 << 18   # heads whose whole score matrix is at most this many elements are batched'
_FIN = 'if a.dtype in (np.float32, np.float64) and a.flags.c_contiguous and a.size:'
_EXEMPT = 'res = np.matmul(a, np.where(bad, 0, b).astype(b.dtype, copy=False), out=out)'
_RUN = 'if blas_controller() is None or n <= 1 or getattr(_local, "worker", False):'
_RESCALE = 'if not (alpha == 1).all():                           # the running max moved: rescale'
R_KEPT_STATE = ("a team thread that never records that it kept its Python thread state asks for it again at every "
                "job: PyGILState_Ensure on a thread that has one only counts up (the state is kept either way)")
_P_BUDGET = "BUDGET = 1 << 22       # scores per compiled tile_tasks call before it returns (an interrupt is seen then)"
_P_KEPT = "KEPT, KEPT_SIZE = 256, 1 << 14   # plans kept across calls: how many, how large (entries)"
R_KEPT = ("how many plans are kept across calls and how large: memory and speed only (that small plans are kept, "
          "and large ones are not, is tested)")
R_PROBE = ("the probe of the compiled tile loop (flash/kernels.py _loop_works): its one task reads the first row "
           "of q, k and v; larger arrays change nothing it reads")
_PLAN_TASKS = 'MIN_TASKS = 8          # split keys (split-KV) or chunk the backward until this many tasks exist'
_PLAN_SPLIT = 'MIN_SPLIT = 1024       # keys per split-KV part at least'
R_FIN = ("which finiteness check all_finite takes (Σx² by one BLAS dot, or a plain sum): either is NaN/inf "
         "exactly when an entry is (x² of NaN/inf is NaN/inf, all other terms >= 0), and an overflowing sum is "
         "re-checked entry by entry, so the answer is the same for every dtype, layout and size")
R_ONE = ("one thread: the job path would run every task on the caller as well (grow(0) starts no worker, no "
         "job is queued): the same calls in the same order, the first error re-raised either way")
_BWD_CHUNKS = "max(1, min(max((len(b) for b in kblocks.values()), default=1), -(-MIN_TASKS // max(len(groups), 1))))"
R_CHUNKS = ("how many chunks of key blocks the backward's tasks take (a tuning choice): dk, dv and dbias are "
            "written by disjoint key blocks, dq summed over the chunks in a fixed order: only the order of dq's "
            "sums changes (a bias broadcast over the keys keeps one chunk: tested)")
_FWD_SORT = 'tasks.sort(key=lambda t: -(t[4] - t[3]) * (blocks[t[0]][2] - blocks[t[0]][1]) * blocks[t[0]][0].nk)'
R_DETACH = ("_np runs where grad mode is off (inside the custom ops, and under no_grad on the eager path and for "
            "the cache), where numpy() takes a tensor that requires grad; the detach is for a caller with grad on")
R_SORT = ("the order tasks are handed to the threads (heaviest first, for balance): each task writes its "
          "own rows or its own split-KV part, merged in part order: speed only")
# flash/plan.py's planning choices (speed and the order of sums only; tests/flash/test_plan.py pins
# what must hold of any plan: each visible pair in one tile, little else computed, one tile of
# scratch, each kv head read once per GQA group)
R_STACK = ("how many heads one unit stacks (small heads batched, a GQA group's heads together, all kv heads "
           "of a page): the same products in other batches — speed and the order of sums only")
R_KEYW = ("how wide a few-row key tile is (never past one tile of scratch, pinned by a test): speed and the "
          "order of sums only")
R_SPLITS = ("how many split-KV parts a row block's keys are cut into: parts merged by their max and sum, the "
            "same results to rounding (split-KV is tested on decoding shapes)")
R_STREAM = "which few-row units take the streaming kernel instead of the tiles: the same sums in another order"
R_STRIPS = ("whether a diagonal tile is cut into row strips: each tile's partial flag is recomputed from its "
            "own bounds, so the band still applies; strips only skip work")
R_NEG = "NumPy's reshape reads any negative size as 'the rest', as it does -1"
_P_STACK1 = "Lq, Sk = seg.q1 - seg.q0, max(seg.k1 - seg.k0, 1)"
_P_STACK2 = "if stackable and G * Lq <= self.BLOCK_M:"
_P_STACK3 = "per_head = G * Lq * Sk"
_P_STACK4 = "nk = max(1, min(Hkv, SMALL_TILE // per_head)) if Sk <= self.BLOCK_N else 1"
_P_DEC = "if self.stream and G * Lq <= DECODE_ROWS and ("
_P_ROWB = "if u.g > 1 or u.nk > 1:"
_P_KW1 = "if not self.tuned or rows >= self.BLOCK_M:"
_P_KW2 = "return max(self.BLOCK_N, (self.BLOCK_M * self.BLOCK_N // max(rows, 1)) // self.BLOCK_N * self.BLOCK_N)"
_P_SPL1 = "if n_tasks >= MIN_TASKS or keys < 2 * MIN_SPLIT:"
_P_SPL2 = "return max(1, min(-(-MIN_TASKS // n_tasks), keys // MIN_SPLIT))"
_P_STRIP = "if u.g * u.nk > 1 or r1 - r0 <= SUB_M or not self.partial(u, r0, r1, c0, c1):"
_P_STR = "return self.stream and u.g * (r1 - r0) <= DECODE_ROWS"
_P_DENSE = "return k, v, np.zeros((1, 1), dtype=np.int64), 0, k.shape[-2]"
_FWD_STEP = "step = call.BLOCK_M if u.g * u.nk == 1 else None"
_FWD_EXP = ("call.kern.exp_from_lse(s.reshape(nk * n_rows, -1), np.ascontiguousarray(lse_h[:, rows])"
            ".reshape(-1))")
R_PIECES = ("how attention_weights cuts the requested rows into tasks (row chunks of BLOCK_M or whole runs): "
            "each piece writes its own rows of w — parallelism and scratch size only")
R_ROWB = ("a stacked unit holds at most BLOCK_M rows (G·Lq <= BLOCK_M), so cutting it into BLOCK_M blocks "
          "gives the same one block")
R_DENSE = "a dense sequence is one page of S keys: the kernel reads only table[0, 0]"
R_LSE_CHECK = ("an lse that is NaN makes p, then ds, NaN wherever its row sees a key, which stops the task there "
               "(zeroed, redone by the Python loop); one of +inf gives p = 0, as the Python loop's exp does")
R_PIECE1 = "without a step the range is one piece [a, z) whatever step larger than z − a it takes"
R_SMALL = ("a tuning constant: where auto hands NumPy and torch CPU calls from the small rung to the flash "
           "rung (both within 1e-12 of the reference): speed and the order of sums only; the rule at each "
           "limit (at most, every dim counted, both limits) is pinned by a test")
R_KNEW = "k_new was validated as (B, Hkv, L_new, D): index 2 is index -2"
R_PROTO = ("a default in the Rung Protocol, which only types the rungs: no call runs its methods (every rung "
           "module and the torch op's bound rungs have their own signatures and defaults)")
_SMALL_FWD = ("def rung_forward(spec: Spec, need_weights: bool = False) -> tuple[np.ndarray, np.ndarray, "
              "np.ndarray | None]:")
_SMALL_RET = "return out.astype(spec.dtype, copy=False), lse, (rung_weights(spec, lse) if need_weights else None)"
EQUIVALENT: dict[tuple[str, str, str], str] = {
    ("spec/checks.py",
     "if not (isinstance(world, int) and world >= 1 and isinstance(rank, int) and 0 <= rank < world):",
     "`1` -> `0`"):
        "world >= 0 only adds world = 0, which 0 <= rank < world refuses anyway",
    ("spec/core.py", "lead + i for i, n in enumerate(shape) if n == 1 and grad.shape[lead + i] != 1",
     "`1` -> `0` @84"):
        "it also sums axes of length 1 (no value changes) and no gradient dim is 0 (validate refuses empty sizes)",
    ("spec/core.py", "causal: bool = False", "`False` -> `True`"):
        "every Spec is made by from_arrays and every caller of it passes causal",
    ("spec/core.py", "two_d: bool = False", "`False` -> `True`"):
        "from_arrays always passes two_d to the constructor",
    ("spec/core.py", "def from_arrays(cls, q: Any, k: Any, v: Any, *, two_d: bool = False,", "`False` -> `True`"):
        "the callers that omit two_d (the torch op, ring blocks) never read it; api, explain and ring read the "
        "validated Spec's",
    ("spec/geometry.py", "if (r, c) == (0, 0) and spec.extent is None:", "`==` -> `!=`"):
        "a shortcut: for the whole problem the loop below shifts by (0, 0) and clips nothing, the same segments",
    ("spec/geometry.py", "if (r, c) == (0, 0) and spec.extent is None:", "`0` -> `1`"):
        "a shortcut: for the whole problem the loop below shifts by (0, 0) and clips nothing, the same segments",
    ("spec/geometry.py", "for p in parts[1:]:", "`1` -> `0`"):
        "the first part is or-ed with itself: the same mask",
    ("spec/geometry.py", "c0: int, c1: int, index: bool = True) -> np.ndarray | None:", "`True` -> `False`"):
        "the default is never used: the one caller (flash.plan) passes index",
    ("spec/kvcache.py", "if Hkv < 1 or H % Hkv:", "`1` -> `0`"):
        "Hkv >= 1 here: a cache with a zero dim was refused above",
    ("spec/kvcache.py", 'k_new = as_array("k_new", k_new, want_torch, required=True)', "`True` -> `False`"):
        "k_new is not None in this branch, so required never applies",
    ("spec/kvcache.py", 'v_new = as_array("v_new", v_new, want_torch, required=True)', "`True` -> `False`"):
        "v_new is not None in this branch (k_new and v_new come together), so required never applies",
    ("spec/kvcache.py", "L_new = int(k_new.shape[-2]) if k_new.ndim == 4 else -1", "drop `-` @32"):
        "k_new.ndim == 4 in that branch: index 2 is index -2",
    ("spec/kvcache.py", "L_new = int(k_new.shape[-2]) if k_new.ndim == 4 else -1", "`1` -> `2`"):
        "a k_new that is not 4-D fails the shape check whatever L_new, and any negative L_new is printed as 'L_new'",
    ("spec/kvcache.py", "S_cap = int(capacity.max()) if B else 0", "`.max` -> `.min`"):
        "capacity is np.full(B, ...): every entry is the same",
    ("spec/kvcache.py", "S_cap = int(capacity.max()) if B else 0", "`0` -> `1`"):
        "B >= 1 here: q with B = 0 was refused above",
    ("spec/validate.py", "return x.reshape((1,) * (nd - x.ndim) + tuple(x.shape)) if x.ndim < nd else x",
     "`<` -> `<=`"):
        "when x.ndim == nd the reshape adds no dim: the same view",
    ("spec/validate.py", "m = _at_least(m, 2)", "`2` -> `1`"):
        "keep/drop/bias are only broadcast to score_shape (gradients reduced to the user's shape): leading 1s "
        "change nothing, and a 0-d mask still becomes an array",
    ("spec/validate.py", "m = _at_least(m, 2)", "`2` -> `3`"):
        "keep/drop/bias are only broadcast to score_shape (gradients reduced to the user's shape): leading 1s "
        "change nothing",
    ("spec/validate.py", "slopes = _at_least(slopes, 1)", "remove the statement"):
        "every rung broadcasts the slopes to batch + (H,); explain reshapes them to the user's shape",
    ("spec/validate.py", "slopes = _at_least(slopes, 1)", "`1` -> `0`"):
        "every rung broadcasts the slopes to batch + (H,); explain reshapes them to the user's shape",
    ("spec/validate.py", "elif sinks.ndim == 0:", "`0` -> `1`"):
        "a 0-d sink then stays 0-d: every rung broadcasts sinks to (..., H, L) and reduces its gradient to ()",
    ("spec/validate.py", "sinks = sinks.reshape(1, 1)                  # one logit for every row",
     "remove the statement"):
        "a 0-d sink then stays 0-d: every rung broadcasts sinks to (..., H, L) and reduces its gradient to ()",
    ("reference.py", "def rung_forward(spec: Spec, need_weights: bool = False) -> tuple[np.ndarray, np.ndarray, "
     "np.ndarray | None]:", "`False` -> `True`"):
        "the callers that use the default (rung_kvcache, the torch op, ring attention) discard the weights",
    ("reference.py", "if k.shape[-2] == 0:                                 # a block table without columns: the Spec's",
     "drop `-`"):
        "the gathered keys are 4-D (B, Hkv, S, D): index 2 is index -2",
    ("flash/runtime.py", "job.cancel = True", "`True` -> `False`"):
        "the except branch (grow or the caller's own loop raised) is followed at once by the finally's "
        "job.cancel = True; nothing reads cancel in between that could not have read it just before the error",
    ("nonfinite.py", _FIN, 'negate the condition'): R_FIN,
    ("nonfinite.py", _FIN, '`in` -> `not in`'): R_FIN,
    ("nonfinite.py", _FIN, '`and` -> `or` @51'): R_FIN,
    ("nonfinite.py", _FIN, '`and` -> `or` @76'): R_FIN,
    ("nonfinite.py", "flat = a.reshape(-1)", "`1` -> `2`"):
        "NumPy reads any negative size in reshape as the inferred one",
    ("nonfinite.py", _EXEMPT, "`0` -> `1`"):
        "the stand-in for a non-finite b entry only meets entries of a outside visible, which every caller has "
        "exactly 0 (the docstring's contract): 0·1 = 0·0, and a NaN a there is NaN either way",
    ("nonfinite.py", _EXEMPT, "`False` -> `True`"): "an extra copy of a fresh array: speed only",
    ("torch/op.py", "dbias = g.dbias if g.dbias is not None and need_dbias else spec.q.new_empty(0)", "`and` -> `or`"):
        "every rung returns dbias None when need_dbias is False, and a dbias when it is True (only with a bias)",
    ("torch/op.py", "dout = torch.zeros_like(out)", "remove the statement"):
        "the custom op's autograd materializes an unused output's gradient as zeros: dout is never None here "
        "(a loss of lse alone is tested)",
    ("flash/runtime.py", _RUN, "`<=` -> `<`"): R_ONE,
    ("flash/runtime.py", _RUN, "`1` -> `0`"): R_ONE,
    ("flash/kernels.py", _RESCALE, "`1` -> `2`"):
        "alpha <= 1 (or NaN), never 2: the rescale then always runs, and skipping it is only a shortcut for "
        "alpha == 1 everywhere (o·1 == o exactly)",
    ("flash/plan.py", _PLAN_TASKS, '`8` -> `7`'):
        "how many split-KV parts a row block's keys (or backward key chunks) are cut into: parts "
        "merged by their max and sum, the same results to rounding (split-KV is tested on decoding shapes)",
    ("flash/plan.py", _PLAN_TASKS, '`8` -> `9`'):
        "how many split-KV parts a row block's keys (or backward key chunks) are cut into: parts "
        "merged by their max and sum, the same results to rounding (split-KV is tested on decoding shapes)",
    ("flash/plan.py", _PLAN_SPLIT, '`1024` -> `1023`'):
        "how many split-KV parts a row block's keys (or backward key chunks) are cut into: parts "
        "merged by their max and sum, the same results to rounding (split-KV is tested on decoding shapes)",
    ("flash/plan.py", _PLAN_SPLIT, '`1024` -> `1025`'):
        "how many split-KV parts a row block's keys (or backward key chunks) are cut into: parts "
        "merged by their max and sum, the same results to rounding (split-KV is tested on decoding shapes)",
    ("flash/runtime.py", "job.cancel = True", "remove the statement"):
        "the finally right below sets job.cancel = True at once (the same reason as its True -> False)",
    ("flash/runtime.py", "job.cancel = True            # every task is claimed or abandoned by now",
     "remove the statement"):
        "after a failure cancel is already True (set by work() or the except above); after success every task "
        "was claimed, so a worker still in the job finds the counter exhausted whatever cancel says",
    ("flash/runtime.py", 'elif cmd == "exit" and tok is not None:', "`and` -> `or`"):
        "it differs only for an exit whose token is already gone, where it pops id(None), never a key of active",
    ("flash/backward.py", "return tuple(0 if n == 1 else i for i, n in zip(u.b + (u.h0,), shape[:-2]))",
     "`2` -> `1`"):
        "zip stops at u.b + (u.h0,), which has len(shape) - 2 entries: the extra dim of shape[:-1] is never read",
    ("flash/backward.py", "ds, r0, r1 = ds.sum(axis=0, keepdims=True), 0, 1", "`1` -> `2`"):
        "bias is broadcast over the rows there: the padded dbias has one row, so the slice 0:2 is 0:1",
    ("flash/backward.py", "ds, c0, c1 = ds.sum(axis=1, keepdims=True), 0, 1", "`1` -> `2` @55"):
        "bias is broadcast over the keys there: the padded dbias has one column, so the slice 0:2 is 0:1",
    ("flash/backward.py", "def backward(call: Call, dout: Any, out: Any, lse: Any, dlse: Any = None, "
     "need_dbias: bool = True) -> Grads:", "`True` -> `False`"):
        "the default is never used: the one caller (flash.rung_backward) passes need_dbias",
    ("flash/backward.py", _BWD_CHUNKS, '`1` -> `2` @12'): R_CHUNKS,
    ("flash/backward.py", _BWD_CHUNKS, '`min` -> `max`'): R_CHUNKS,
    ("flash/backward.py", _BWD_CHUNKS, '`max` -> `min` @19'): R_CHUNKS,
    ("flash/backward.py", _BWD_CHUNKS, '`1` -> `2` @67'): R_CHUNKS,
    ("flash/backward.py", _BWD_CHUNKS, 'drop `-`'): R_CHUNKS,
    ("flash/backward.py", _BWD_CHUNKS, '`max` -> `min` @87'): R_CHUNKS,
    ("flash/backward.py", _BWD_CHUNKS, '`1` -> `2` @104'): R_CHUNKS,
    ("flash/backward.py", _BWD_CHUNKS, '`1` -> `0` @67'):
        "call.units and the groups are never empty (L, H >= 1), so neither the default nor max(., 0) "
        "changes the value",
    ("flash/backward.py", _BWD_CHUNKS, '`1` -> `0` @104'):
        "call.units and the groups are never empty (L, H >= 1), so neither the default nor max(., 0) "
        "changes the value",
    ('flash/forward.py', 'return x.astype(dtype, copy=False)',
     '`False` -> `True`'):
        'an extra copy of the result: speed only',
    **{("flash/kernels.py", "q = np.ones((1, 1, 1, 1), dtype=np.float32)", f"`1` -> `2` @{col}"): R_PROBE
       for col in (17, 20, 23, 26)},
    **{("flash/kernels.py", line, what): R_PROBE for line, what in (
        ("tiles, none = np.array([[0, 1, 0, 1, 0]]), np.zeros(0, dtype=np.int64)   # bounds: no banded tile",
         "`0` -> `1` @56"),
        ("out, lse, status = np.zeros((1, 1, 1, 1), np.float32), np.zeros((1, 1, 1), np.float32), np.zeros(2, np.int8)",
         "`1` -> `2` @75"),
        ("empty = np.zeros((0, 0, 0), dtype=np.float32)", "`0` -> `1` @22"),
        ("out, lse, sm, sl, sacc, 1 << 20)", "`20` -> `19`"), ("out, lse, sm, sl, sacc, 1 << 20)", "`20` -> `21`"))},
    ("flash/kernels.py",
     "table = np.array([[0] * 6 + [1, 1, 0, 1, 0, 1, -1, -1, 0], [0] * 6 + [1, 1, 0, 1, 0, 1, -1, 0, 0]])",
     "`1` -> `2` @56"):
        "the probe's first task keeps no state (so = −2 is below 0 as −1 is): finished into out and lse either way",
    ("flash/numba_loop.py", "one = tiles.shape[0] == 1 and tiles[0, 0] == 0 and tiles[0, 1] == R", "`0` -> `1` @40"):
        "whether the single tile's product is written straight into acc or added to acc = 0 (0·α + pv = pv): "
        "the same values; the mutant reads past a one-row table (numba checks no bounds), so it only changes "
        "which of the two ways is taken",
    ("flash/numba_loop.py", "if c0 != K0 or c1 > K1:", "`>` -> `>=` @26"):
        "a key block already transposed is transposed again when the tile ends exactly where it does: speed only",
    ("flash/runtime.py", "_local.kept = ctypes.pythonapi.PyGILState_Ensure() is not None", "remove the statement @8"):
        R_KEPT_STATE,
    ("flash/runtime.py", "_local.kept = ctypes.pythonapi.PyGILState_Ensure() is not None", "`is not` -> `is` @59"):
        R_KEPT_STATE,
    ("flash/forward.py", "counter, status = np.zeros(1, dtype=np.int64), np.zeros(len(table), dtype=np.int8)",
     "`1` -> `0` @31"):
        "a counter of size 0: the compiled loop (numba checks no bounds) still counts in its first slot, past "
        "the array's end: undefined behaviour only a bounds-checked build could show",
    ('spec/core.py', 'if x.ndim < 3 or x.shape[-3] < 2 or x.shape[-2] < 2:',
     '`2` -> `1` @49'):
        "L = 1 then goes on to compare strides: a size-1 row axis has the same memory order in either layout; "
        "D = 1 with L > 1 writes out in C order, which the op lays out as q's (a copy, not a value)",
    ('spec/core.py', 'return False',
     '`False` -> `True` @15'):
        "a size-1 head or row axis has the same memory order in either layout, and below 3 dims heads_inner "
        "is never asked (validate makes q at least 3-D)",
    ('flash/plan.py', _P_BUDGET, '`1` -> `2`'):
        "how many scores a compiled tile_tasks call does before it returns to Python (where an interrupt is "
        "seen): each task is done by one call, whichever; responsiveness and speed only",
    ('flash/plan.py', _P_KEPT, '`256` -> `257` @18'): R_KEPT,
    ('flash/plan.py', _P_KEPT, '`256` -> `255` @18'): R_KEPT,
    ('flash/plan.py', _P_KEPT, '`14` -> `13` @28'): R_KEPT,
    ('flash/plan.py', _P_KEPT, '`14` -> `15` @28'): R_KEPT,
    ('flash/plan.py', _P_KEPT, '`1` -> `2` @23'): R_KEPT,
    ('flash/forward.py', 'if weights is not None and q_t is not None:', '`and` -> `or`'):
        'q_t is made exactly when weights are wanted (the test is for the type checker)',
    ('flash/forward.py', 'if acc is not None and pv is not None and v_t is not None:',
     '`and` -> `or` @27'):
        'acc and pv are both None or both arrays (want_out); v_t is None only for calls without v, which '
        'never want out',
    ('flash/forward.py', 'kern.rescale_add(acc.reshape(nk * n_rows, -1), alpha, pv.reshape(nk * n_rows, -1))',
     '`1` -> `2` @59'):
        'NumPy reads any negative size in reshape as the inferred one',
    ('flash/forward.py', 'kern.rescale_add(acc.reshape(nk * n_rows, -1), alpha, pv.reshape(nk * n_rows, -1))',
     '`1` -> `2` @95'):
        'NumPy reads any negative size in reshape as the inferred one',
    ('flash/forward.py', 'slopes = diag = np.zeros(0, dtype=np.float32)',
     '`0` -> `1`'):
        'the streaming kernel applies ALiBi only when slopes has one entry per row (A·R); for one row the '
        'placeholder slope 0 subtracts 0·|0 − p| = 0',
    ('flash/forward.py', 'if work <= NATIVE_WORK:',
     '`<=` -> `<`'):
        'only a call of exactly NATIVE_WORK scores changes path; the one pass and the passes give the same bits '
        '(test_one_native_pass_on_torchs_team_gives_the_passes_bits)',
    ('small.py', 'STREAM_ROWS = 16',
     '`16` -> `17`'):
        'a bound on speed only: calls of 17 rows per kv head take the compiled call instead of the products, '
        'both checked against the reference (test_small)',
    ('flash/forward.py', 'if z > a:',
     '`>` -> `>=`'):
        "z == a: the kernel's key loop runs zero times, the state is unchanged",
    ('flash/forward.py', 'for p in parts[1:]:',
     '`1` -> `0`'):
        'the first part is maxed with itself: the same maximum',
    ('flash/forward.py', 'acc = None if parts[0][2] is None else np.zeros_like(parts[0][2])',
     '`0` -> `1` @24'):
        'every part of a row block has an acc or none (want_out), of the same shape',
    ('flash/forward.py', 'acc = None if parts[0][2] is None else np.zeros_like(parts[0][2])',
     '`0` -> `1` @63'):
        'every part of a row block has an acc or none (want_out), of the same shape',
    ('flash/forward.py', 'if acc is not None and pa is not None:',
     '`and` -> `or`'):
        "acc is None exactly when the parts' acc are",
    ('flash/forward.py', 'acc += w.reshape(pa.shape[0], -1, 1) * pa',
     '`1` -> `2` @43'):
        'NumPy reads any negative size in reshape as the inferred one',
    ('flash/forward.py', 'n = call.splits(len(blocks), hi - lo)',
     '`-` -> `+`'):
        'a split-KV part count from another key count (a tuning choice): parts are merged exactly, an empty '
        'part weighs 0',
    ('flash/forward.py', 'cuts = [lo + (hi - lo) * i // n for i in range(n + 1)]',
     '`-` -> `+`'):
        "other cut points that still partition [lo, hi) (the last part runs past hi, clipped to the band's "
        'keys): the same merge to rounding',
    ('flash/forward.py', 'cuts = [lo + (hi - lo) * i // n for i in range(n + 1)]',
     '`1` -> `2`'):
        'one extra cut point, never read',
    ('flash/forward.py', 'tasks += [(n_b, i, n, cuts[i], cuts[i + 1]) for i in range(n)]',
     '`+` -> `-`'):
        'part 0 then spans [lo, hi) (cuts[-1] is hi) and every other part an empty range: the same merge to rounding',
    ('flash/forward.py', 'parts: dict[int, list[Any]] = {n_b: [None] * n for n_b, i, n, _, _ in tasks if n > 1 and i'
     ' == 0}',
     '`==` -> `!=`'):
        'a split row block has parts 0 and 1 (n > 1): the same keys either way',
    ('flash/forward.py', 'parts: dict[int, list[Any]] = {n_b: [None] * n for n_b, i, n, _, _ in tasks if n > 1 and i'
     ' == 0}',
     '`0` -> `1`'):
        'a split row block has parts 0 and 1 (n > 1): the same keys either way',
    ('flash/forward.py', _FWD_SORT, 'remove the statement'): R_SORT,
    ('flash/forward.py', _FWD_SORT, '`4` -> `3`'): R_SORT,
    ('flash/forward.py', _FWD_SORT, '`-` -> `+` @36'): R_SORT,
    ('flash/forward.py', _FWD_SORT, '`3` -> `2`'): R_SORT,
    ('flash/forward.py', _FWD_SORT, '`3` -> `4`'): R_SORT,
    ('flash/forward.py', _FWD_SORT, '`*` -> `/` @44'): R_SORT,
    ('flash/forward.py', _FWD_SORT, '`2` -> `1`'): R_SORT,
    ('flash/forward.py', _FWD_SORT, '`-` -> `+` @63'): R_SORT,
    ('flash/forward.py', _FWD_SORT, '`1` -> `2`'): R_SORT,
    ('flash/forward.py', _FWD_SORT, '`*` -> `/` @82'): R_SORT,
    ("torch/op.py", "return torch.randint(0, 1 << 62, (), dtype=torch.int64)", "`0` -> `1`"):
        "the range a seed is drawn from when none is given: any drawn seed is as good (not observable beyond "
        "which random seed it is)",
    ("torch/op.py", "return torch.randint(0, 1 << 62, (), dtype=torch.int64)", "`62` -> `61`"):
        "the range a seed is drawn from when none is given: any drawn seed is as good (not observable beyond "
        "which random seed it is)",
    ("torch/op.py", 'need_dbias = args[_OPT_INDEX["bias"]] is not None and ctx.needs_input_grad[_OPT_INDEX["bias"]]',
     "`and` -> `or`"):
        "a dbias computed for a bias that needs no gradient is dropped below (res only where needs_input_grad)",
    ("torch/op.py", "if args[pos] is not None and ctx.needs_input_grad[pos] and g < len(grads):", "`and` -> `or` @33"):
        "autograd drops a gradient returned for an input that needs none; a None input needs none",
    ("torch/op.py", "if args[pos] is not None and ctx.needs_input_grad[pos] and g < len(grads):", "`<` -> `<=`"):
        "g <= 4 < len(grads) = 5 always: the bound is never reached",
    ("torch/op.py", "res[pos] = grads[g] if grads[g].numel() or args[pos].numel() == 0 else None", "`==` -> `!=`"):
        "grads[g] is an empty placeholder only where no gradient is wanted (skipped above); inputs are never empty",
    ("torch/op.py", "res[pos] = grads[g] if grads[g].numel() or args[pos].numel() == 0 else None", "`0` -> `1`"):
        "grads[g] is an empty placeholder only where no gradient is wanted (skipped above); inputs are never empty",
    ("torch/op.py", "def rung_forward(self, spec: Spec, need_weights: bool = False) -> tuple[Any, Any, Any]:",
     "`False` -> `True`"):
        "the one caller that uses the default (ring attention) discards the weights",
    ("torch/op.py", "g = torch.ops.attnkit.attention_bwd(dout, dlse, out, lse, need_dbias and spec.bias is not None,",
     "`and` -> `or`"):
        "every caller passes need_dbias=True (the default); then it differs only without a bias, where no rung "
        "returns a dbias",
    ("flash/runtime.py", "_fork_hooks.append(True)", "`True` -> `False`"):
        "_fork_hooks is only tested for emptiness: [False] is as non-empty as [True]",
    ("flash/backward.py", "if dbias is not None and bias_shape is not None:", "`and` -> `or`"):
        "dbias is allocated exactly when bias_shape is not None: both or neither",
    # flash/plan.py's tuning table and constants: only speed and the order of sums change (the
    # rungs are compared to 1e-12); the doctest of block_sizes pins the D <= 128 forward entry
    ("flash/plan.py", _PLAN_BWD, '`256` -> `255` @16'): R_BLOCK,
    ("flash/plan.py", _PLAN_BWD, '`256` -> `257` @16'): R_BLOCK,
    ("flash/plan.py", _PLAN_BWD, '`256` -> `255` @21'): R_BLOCK,
    ("flash/plan.py", _PLAN_BWD, '`256` -> `257` @21'): R_BLOCK,
    ("flash/plan.py", _PLAN_BWD, 'negate the condition'): R_BLOCK,
    ("flash/plan.py", _PLAN_BWD, '`<=` -> `<`'): R_BLOCK,
    ("flash/plan.py", _PLAN_BWD, '`128` -> `127` @34'): R_BLOCK,
    ("flash/plan.py", _PLAN_BWD, '`128` -> `129` @34'): R_BLOCK,
    ("flash/plan.py", _PLAN_BWD, '`128` -> `127` @44'): R_BLOCK,
    ("flash/plan.py", _PLAN_BWD, '`128` -> `129` @44'): R_BLOCK,
    ("flash/plan.py", _PLAN_BWD, '`256` -> `255` @49'): R_BLOCK,
    ("flash/plan.py", _PLAN_BWD, '`256` -> `257` @49'): R_BLOCK,
    ("flash/plan.py", _PLAN_FWD, '`<=` -> `<`'): R_BLOCK,
    ("flash/plan.py", _PLAN_FWD, '`128` -> `127`'): R_BLOCK,
    ("flash/plan.py", _PLAN_FWD, '`128` -> `129`'): R_BLOCK,
    ("flash/plan.py", _PLAN_FWD, '`512` -> `511` @41'): R_BLOCK,
    ("flash/plan.py", _PLAN_FWD, '`512` -> `513` @41'): R_BLOCK,
    ("flash/plan.py", _PLAN_FWD, '`512` -> `511` @46'): R_BLOCK,
    ("flash/plan.py", _PLAN_FWD, '`512` -> `513` @46'): R_BLOCK,
    ("flash/plan.py", _PLAN_SUB, "`128` -> `127`"):
        "the height of the row strips a causal/window band cuts through: which tiles are clipped or merged, "
        "the same results (tests set SUB_M to 1..5 to exercise the strips)",
    ("flash/plan.py", _PLAN_SUB, "`128` -> `129`"):
        "the height of the row strips a causal/window band cuts through: which tiles are clipped or merged, "
        "the same results (tests set SUB_M to 1..5 to exercise the strips)",
    ("flash/plan.py", _PLAN_DEC, "`64` -> `63`"):
        "which few-row units take the streaming kernel instead of the tiles: the same sums in another order",
    ("flash/plan.py", _PLAN_DEC, "`64` -> `65`"):
        "which few-row units take the streaming kernel instead of the tiles: the same sums in another order",
    ("flash/plan.py", _PLAN_SMALL, '`1` -> `2`'):
        "how many small heads one task batches (a batched matmul of the same products): speed only",
    ("flash/plan.py", _PLAN_SMALL, '`18` -> `17`'):
        "how many small heads one task batches (a batched matmul of the same products): speed only",
    ("flash/plan.py", _PLAN_SMALL, '`18` -> `19`'):
        "how many small heads one task batches (a batched matmul of the same products): speed only",
    ("flash/plan.py", "x = np.asarray(x)", "remove the statement"):
        "every caller passes a NumPy array (validated operands, gathered pages)",
    ("flash/plan.py", "bm, bn = block_sizes(max(spec.D, spec.Dv), spec.acc_dtype, backward)", "`max` -> `min`"):
        R_BLOCK,
    ("flash/plan.py", "self.tuned = block_m is None and block_n is None", "`and` -> `or`"):
        "with one of block_m/block_n given, whether few-row tiles widen and few rows stream: speed and the "
        "order of sums only",
    ("flash/plan.py", "if spec.dropout > 0:", "`>` -> `>=`"):
        "philox.threshold(0.0) is 0, which turns dropout off exactly as not setting it does",
    ("flash/plan.py", _P_STACK1, "`-` -> `+` @32"): R_STACK,
    ("flash/plan.py", _P_STACK1, "`-` -> `+` @53"): R_STACK,
    ("flash/plan.py", _P_STACK1, "`1` -> `2`"): R_STACK,
    ("flash/plan.py", _P_STACK2, "`*` -> `/`"): R_STACK,
    ("flash/plan.py", _P_STACK2, "`<=` -> `<`"): R_STACK,
    ("flash/plan.py", _P_STACK3, "`*` -> `/` @33"): R_STACK,
    ("flash/plan.py", _P_STACK3, "`*` -> `/` @38"): R_STACK,
    ("flash/plan.py", _P_STACK4, "`1` -> `2` @29"): R_STACK,
    ("flash/plan.py", _P_STACK4, "`min` -> `max`"): R_STACK,
    ("flash/plan.py", _P_STACK4, "`<=` -> `<`"): R_STACK,
    ("flash/plan.py", _P_STACK4, "`1` -> `2` @93"): R_STACK,
    ("flash/plan.py", _P_DEC, "negate the condition"): R_STACK,
    ("flash/plan.py", _P_DEC, "`and` -> `or` @35"): R_STACK,
    ("flash/plan.py", _P_DEC, "`*` -> `/`"): R_STACK,
    ("flash/plan.py", _P_DEC, "`<=` -> `<`"): R_STACK,
    ("flash/plan.py", _P_DEC, "`and` -> `or` @61"): R_STACK,
    ("flash/plan.py", "nk = Hkv", "remove the statement"): R_STACK,
    ("flash/plan.py", _P_ROWB, "`1` -> `2` @29"): R_ROWB,
    ("flash/plan.py", _P_ROWB, "`or` -> `and`"): R_ROWB,
    ("flash/plan.py", _P_ROWB, "`1` -> `2` @17"): R_ROWB,
    ("flash/plan.py", "rows = u.nk * u.g * (r1 - r0)", "`-` -> `+`"): R_KEYW,
    ("flash/plan.py", _P_KW1, "drop `not`"): R_KEYW,
    ("flash/plan.py", _P_KW1, "negate the condition"): R_KEYW,
    ("flash/plan.py", _P_KW1, "`or` -> `and`"): R_KEYW,
    ("flash/plan.py", _P_KW1, "`>=` -> `>`"): R_KEYW,
    ("flash/plan.py", _P_KW2, "`max` -> `min` @15"): R_KEYW,
    ("flash/plan.py", _P_KW2, "`*` -> `/` @47"): R_KEYW,
    ("flash/plan.py", _P_KW2, "`1` -> `0`"): "rows >= 1 always: max(rows, 0) == max(rows, 1)",
    ("flash/plan.py", _P_KW2, "`1` -> `2`"): R_KEYW,
    ("flash/plan.py", _P_KW2, "`*` -> `/` @95"): R_KEYW,
    ("flash/plan.py", _P_SPL1, "`>=` -> `>`"): R_SPLITS,
    ("flash/plan.py", _P_SPL1, "`or` -> `and`"): R_SPLITS,
    ("flash/plan.py", _P_SPL1, "`<` -> `<=`"): R_SPLITS,
    ("flash/plan.py", _P_SPL1, "`2` -> `1`"): R_SPLITS,
    ("flash/plan.py", _P_SPL1, "`*` -> `/`"): R_SPLITS,
    ("flash/plan.py", _P_SPL2, "`1` -> `0`"):
        "reached only with keys >= 2·MIN_SPLIT and fewer than MIN_TASKS tasks, where both min terms are >= 1",
    ("flash/plan.py", _P_SPL2, "`1` -> `2`"): R_SPLITS,
    ("flash/plan.py", _P_SPL2, "`min` -> `max`"): R_SPLITS,
    ("flash/plan.py", _P_STRIP, "`-` -> `+`"): R_STRIPS,
    ("flash/plan.py", _P_STRIP, "`<=` -> `<`"): R_STRIPS,
    ("flash/plan.py", _P_STRIP, "`or` -> `and` @50"): R_STRIPS,
    ("flash/plan.py", "g = g.transpose(1, 0, 2, 3).reshape(u.nk, (p1 - p0) * P, -1)", "`1` -> `2`"): R_NEG,
    ("flash/plan.py", "return np.asarray(arr[u.b][u.heads, r0:r1]).reshape(-1)", "`1` -> `2`"): R_NEG,
    ("flash/plan.py", "self.kern.dropout_tile(p.reshape(u.nk * u.g, r1 - r0, -1), self.flat_heads(u), r0 + r, "
     "c0 + c,", "`1` -> `2`"): R_NEG,
    ("flash/plan.py", "index = partial and not fused", "`and` -> `or`"):
        "the band written by index into tiles it does not cut as well: it excludes nothing there",
    ("flash/plan.py", _P_STR, "`*` -> `/`"): R_STREAM,
    ("flash/plan.py", _P_STR, "`-` -> `+`"): R_STREAM,
    ("flash/plan.py", _P_STR, "`<=` -> `<`"): R_STREAM,
    ("flash/plan.py", _P_DENSE, "`1` -> `2` @31"): R_DENSE,
    ("flash/plan.py", _P_DENSE, "`1` -> `2` @34"): R_DENSE,
    ("flash/plan.py", _P_DENSE, "drop `-`"): "k here is (1, Hkv, S, D): k.shape[2] is k.shape[-2]",
    ("flash/forward.py", _FWD_SORT, "`0` -> `1` @56"): R_SORT,
    ("flash/forward.py", _FWD_SORT, "`0` -> `1` @74"): R_SORT,
    ("flash/forward.py", _FWD_SORT, "`0` -> `1` @93"): R_SORT,
    ("flash/forward.py", _FWD_EXP, "`1` -> `2` @55"): R_NEG,
    ("flash/forward.py", _FWD_EXP, "`1` -> `2` @105"): R_NEG,
    ("flash/forward.py", _FWD_STEP, "negate the condition"): R_PIECES,
    ("flash/forward.py", _FWD_STEP, "`*` -> `/`"): R_PIECES,
    ("flash/forward.py", _FWD_STEP, "`==` -> `!=`"): R_PIECES,
    ("flash/forward.py", _FWD_STEP, "`1` -> `0`"): R_PIECES,
    ("flash/forward.py", _FWD_STEP, "`1` -> `2`"): R_PIECES,
    ("flash/forward.py", "for c in range(a, z, step or max(z - a, 1)):", "`-` -> `+`"): R_PIECE1,
    ("flash/forward.py", "for c in range(a, z, step or max(z - a, 1)):", "`1` -> `2`"): R_PIECE1,
    ("flash/forward.py", "rows = np.asarray(rows, dtype=np.int64).ravel()", "remove the statement"):
        "rows arrive as a 1-D int64 array (check_rows; through the torch op, rows.cpu().numpy())",
    ("flash/plan.py", "and (pages is None or pages[0].dtype == self.acc))", "`0` -> `1`"):
        "pages[1] is the v cache, which has k's dtype: validate_kvcache refuses a k_cache or v_cache whose "
        "dtype is not q's",
    ("small.py", "rows = s.reshape(-1, S)", "`1` -> `2`"): R_NEG,
    ("small.py", _SMALL_FWD, "`False` -> `True`"):
        "the callers that use the default (the torch op, rung_kvcache) discard the weights",
    ("small.py", _SMALL_RET, "`False` -> `True`"):
        "a copy of out, which was just computed and is shared with nothing: speed only",
    ("backends.py", "def rung_forward(self, spec: Spec, need_weights: bool = False) -> tuple[Any, Any, Any]:",
     "`False` -> `True`"): R_PROTO,
    ("backends.py", "need_dbias: bool = True) -> Grads:", "`True` -> `False`"): R_PROTO,
    ("backends.py", "SMALL_TOTAL = 1 << 20", "`1` -> `2`"): R_SMALL,
    ("backends.py", "SMALL_TOTAL = 1 << 20", "`20` -> `19`"): R_SMALL,
    ("backends.py", "SMALL_TOTAL = 1 << 20", "`20` -> `21`"): R_SMALL,
    ("backends.py", "SMALL_KV = 1 << 21", "`1` -> `2`"): R_SMALL,
    ("backends.py", "SMALL_KV = 1 << 21", "`21` -> `20`"): R_SMALL,
    ("backends.py", "SMALL_KV = 1 << 21", "`21` -> `22`"): R_SMALL,
    ("kvcache.py", "L_new = kv.k_new.shape[-2]", "drop `-`"): R_KNEW,
    ("kvcache.py", "if kv.k_new is None or kv.k_new.shape[-2] == 0 or (kv.new_lengths is not None and not bool(",
     "drop `-`"): R_KNEW,
    ("kvcache.py", "b = _xp_arange(xp_new, pos.shape[0]).reshape(-1, 1) + 0 * pos", "`+` -> `-`"):
        "0 * pos is all zeros (it only broadcasts the row index to pos's shape): adding or subtracting it is the same",
    ("kvcache.py", "width = max((len(self._pages[self._check(s)]) for s in seqs), default=0)", "`0` -> `1`"):
        "the default applies only to an empty seqs list, and the table's width is max(width, 1) either way",
    ("api.py", "if sys.version_info >= (3, 11):     # at run time too: typing.get_type_hints (pydantic, beartype)",
     "`>=` -> `>`"):
        "sys.version_info has five fields, so it is > (3, 11) exactly when it is >= (3, 11)",
    ("hf.py", "if position_ids is None or position_ids.dim() != 2 or position_ids.shape[0] != 1 or "
              "position_ids.shape[1] < 2:", "`2` -> `1` @112"):
        "one position has no restart to find: the next lines return None for it as well",
    ("hf.py", "if square and bool((pad.int().diff(dim=-1) <= 0).all()):", "drop `-`"): R_2D_MASK,
    ("hf.py", 'res = dict(kv_lengths=pad.sum(-1), align="top_left")', "drop `-`"): R_2D_MASK,
    ("hf.py", "L, S = query.shape[-2], key.shape[-2]", "drop `-` @23"): R_4D,
    ("hf.py", "L, S = query.shape[-2], key.shape[-2]", "drop `-` @38"): R_4D,
    ("hf.py", "window = None if sliding is None else (int(sliding) - 1, 0 if causal else int(sliding) - 1)",
     "`0` -> `1`"):
        "the right side is read only with causal=True, whose band keeps min(right, 0) = 0 (the packed mask's "
        "check as well: causal's tril already hides what tril(1) would add)",
    ("hf.py", "T = attention_mask.shape[-1]", "drop `-`"): R_2D_MASK,
    ("hf.py", "and (attention_mask is None or attention_mask.shape[-1] <= kv_length):", "drop `-`"): R_2D_MASK,
    ("hf.py", "if attention_mask.shape[-1] == kv_length and not _compiling() and bool(attention_mask.all()):",
     "drop `-`"): R_2D_MASK,
    ("hf.py", "if T < S:                                         # a static cache: slots past T are empty",
     "`<` -> `<=`"):
        "at T = S the cut keeps every key and the bias whole, and the weights need no padding: the same call",
    ("small.py", _SMALL_ROWS, "`1` -> `2`"): R_KEPT,
    ("small.py", _SMALL_ROWS, "`16` -> `15`"): R_KEPT,
    ("small.py", _SMALL_ROWS, "`16` -> `17`"): R_KEPT,
    ("small.py", "if spec.q_lengths is None and spec.kv_lengths is None and prod(spec.lse_shape) <= _BOUNDS_ROWS:",
     "`<=` -> `<`"): R_KEPT,
    ("small.py", "if len(_BOUNDS) >= 64:", "`64` -> `63`"): R_KEPT,
    ("spec/kvcache.py", "S_cap = P if block_table is None else int(block_table.shape[1]) * P   # checks them "
                        "when it runs", "`1` -> `0`"): R_TRACED,
    ("spec/kvcache.py", "backend=backend, kv_lengths=lengths.long() + (q_lengths.long() if ragged else L_new),",
     "`+` -> `-`"): R_TRACED,
    ("spec/kvcache.py", "backend=backend, kv_lengths=lengths.long() + (q_lengths.long() if ragged else L_new),",
     "negate the condition"): R_TRACED,
    ("hf.py", 'if opts.get("bias") is not None and opts["bias"].shape[-1] > T:', "`>` -> `>=`"):
        "a bias of exactly T keys cut to its first T is the same bias",
    ("hf.py", 'opts.update(causal=causal and L > 1, align="bottom_right")', "`>` -> `>=`"): R_ONE_ROW,
    ("hf.py", 'opts.update(causal=causal and L > 1, align="bottom_right")', "`1` -> `0`"): R_ONE_ROW,
    ("hf.py", 'trusted = _TRUSTED[kind] = all(bool(getattr(c, "_supports_attention_backend", False)',
     "`False` -> `True`"): R_PRETRAINED,
    ("hf.py", 'or getattr(c, "_supports_sdpa", False)) for c in _model_classes(kind))', "`False` -> `True`"):
        R_PRETRAINED,
    ("hf.py", "unknown = [] if kwargs.keys() <= _KNOWN else sorted(n for n, x in kwargs.items()", "`<=` -> `<`"):
        "only where the keywords are exactly every known one does the call take the other branch, which "
        "finds no unknown keyword either: speed only",
    ("small.py", "_NO_STATE, _NO_BOUNDS = np.zeros((1, 0), dtype=np.float32), np.zeros((1, 0), dtype=np.int64)",
     "`1` -> `2` @70"): "small_rows reads only that the bounds have no columns (lo.shape[1] == 0)",
    ("small.py", "if x.shape[:-3] != batch:", "drop `-`"):
        "x.shape[:3] differs from the batch dims for every operand (it includes the heads): the broadcast then "
        "runs for operands that already have them, a view of the same shape",
    ("small.py", "x = x.reshape(N, A, -1, x.shape[-1])", "`1` -> `2`"):
        "NumPy takes any negative size as the one it infers",
    ("flash/backward.py", "big = float(np.finfo(acc).max) / 4", "`4` -> `5`"):
        "a lower bound only has ds checked in more tiles (the check finds it finite there): the same gradients",
    ("flash/plan.py",
     "return (np.array(rows, dtype=np.int64).reshape(-1, 13), np.array(tiles, dtype=np.int64).reshape(-1, 6),",
     "`1` -> `2`"): "NumPy takes any negative size as the one it infers",
    ("flash/plan.py", "if any(x[4] for x in t):", "`4` -> `3`"):
        "bounds made for a task without banded tiles are never read (only a banded tile reads them)",
    ("flash/numba_backward.py", "if np.isnan(c) or c == np.inf:", "`or` -> `and`"): R_LSE_CHECK,
    ("flash/numba_backward.py", "ldk = max(k.strides[0] // 4, D, 1) if k.shape[0] > 1 else max(D, 1)", "`1` -> `0`"):
        "D >= 1 (validated): max(D, 0) is max(D, 1)",
    ("flash/numba_backward.py", "z += y * f32(0.0)", "`+=` -> `-=`"):
        "a sum of zeros, or NaN once any term is: its sign is never read",
    ("flash/numba_backward.py", "ldv = max(v.strides[0] // 4, Dv, 1) if v.shape[0] > 1 else max(Dv, 1)", "`0` -> `1`"):
        "BLAS reads one row of a single-row operand: any leading dim of at least Dv serves, and max(stride, Dv, 1) "
        "is one",
    ("flash/numba_backward.py", "ldk = max(k.strides[0] // 4, D, 1) if k.shape[0] > 1 else max(D, 1)", "`0` -> `1`"):
        "BLAS reads one row of a single-row operand: any leading dim of at least D serves, and max(stride, D, 1) "
        "is one",
    ("spec/core.py",
     "chosen: dict[tuple[Any, str | None], Any] | None = field(default=None, compare=False, repr=False)",
     "`False` -> `True` @83"): "no code compares or hashes Specs (their equality, with the kept rungs or without)",
    ("spec/core.py",
     "chosen: dict[tuple[Any, str | None], Any] | None = field(default=None, compare=False, repr=False)",
     "`False` -> `True` @95"): "a Spec's repr only (never parsed)",
    ("torch/op.py", "if t.requires_grad:", "negate the condition"): R_DETACH,
    ("torch/op.py", "t = t.detach()", "remove the statement"): R_DETACH,
}


def equivalent_reason(m: Mutant) -> str | None:
    """Why m is judged equivalent (EQUIVALENT), or None."""
    return EQUIVALENT.get(m.key) or EQUIVALENT.get((m.module, m.original, f"{m.what} @{m.start[1]}"))


# ---- mutants ---------------------------------------------------------------------------
@dataclass
class Mutant:
    module: str                  # under src/attnkit
    line: int                    # 1-based
    end_line: int
    kind: str
    what: str                    # "`<` -> `<=`"
    original: str                # the original line, stripped
    mutated: str                 # the first mutated line, stripped
    start: tuple[int, int] = (0, 0)      # (line, char col) of the replaced span
    end: tuple[int, int] = (0, 0)
    replacement: str = ""
    status: str = ""             # killed | survived | timeout | crash | equivalent
    detail: str = ""
    seconds: float = 0.0
    ident: str = ""              # stable across line shifts: module, line text, mutation, column
    cover: tuple[int, int] = (0, 0)      # lines whose execution reaches the mutated code

    @property
    def key(self) -> tuple[str, str, str]:
        return self.module, self.original, self.what


    def apply(self, lines: list[str]) -> str:
        (l1, c1), (l2, c2) = self.start, self.end
        head, tail = lines[l1 - 1][:c1], lines[l2 - 1][c2:]
        return "".join(lines[:l1 - 1] + [head + self.replacement + tail] + lines[l2:])


_CMP = {ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="), ast.GtE: (">=", ">"),
        ast.Eq: ("==", "!="), ast.NotEq: ("!=", "=="), ast.Is: ("is", "is not"), ast.IsNot: ("is not", "is"),
        ast.In: ("in", "not in"), ast.NotIn: ("not in", "in")}
_BIN = {ast.Add: ("+", "-"), ast.Sub: ("-", "+"), ast.Mult: ("*", "/"), ast.Div: ("/", "*"),
        ast.BitAnd: ("&", "|"), ast.BitOr: ("|", "&"), ast.BitXor: ("^", "|"),
        ast.LShift: ("<<", ">>"), ast.RShift: (">>", "<<")}
_MINMAX = {"min": "max", "max": "min", "minimum": "maximum", "maximum": "minimum", "amin": "amax",
           "amax": "amin"}
_TYPE_NAMES = {"int", "float", "str", "bool", "bytes", "tuple", "list", "dict", "set", "None", "Any"}


class _Source:
    """A module's text with AST (UTF-8 byte) offsets turned into character offsets, and
    its tokens for finding operators."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.lines = text.splitlines(keepends=True)
        self.tokens = [t for t in tokenize.generate_tokens(io.StringIO(text).readline)
                       if t.type in (tokenize.OP, tokenize.NAME)]

    def col(self, line: int, byte_col: int) -> int:
        return len(self.lines[line - 1].encode("utf-8")[:byte_col].decode("utf-8"))

    def start(self, node: ast.AST) -> tuple[int, int]:
        return node.lineno, self.col(node.lineno, node.col_offset)  # type: ignore[attr-defined]

    def end(self, node: ast.AST) -> tuple[int, int]:
        return node.end_lineno, self.col(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]

    def segment(self, a: tuple[int, int], b: tuple[int, int]) -> str:
        (l1, c1), (l2, c2) = a, b
        if l1 == l2:
            return self.lines[l1 - 1][c1:c2]
        return self.lines[l1 - 1][c1:] + "".join(self.lines[l1:l2 - 1]) + self.lines[l2 - 1][:c2]

    def find(self, a: tuple[int, int], b: tuple[int, int], sym: str) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """The span of operator ``sym`` (one or two tokens: "is not", "not in") between a and b."""
        toks = [t for t in self.tokens if a <= t.start and t.end <= b]
        parts = sym.split()
        for i, t in enumerate(toks):
            if [x.string for x in toks[i:i + len(parts)]] == parts:
                return t.start, toks[i + len(parts) - 1].end
        return None


def _is_literal_seq(node: ast.AST) -> bool:
    if isinstance(node, (ast.Tuple, ast.List, ast.JoinedStr)):
        return True
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
        return True
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("tuple", "list", "str")


def _is_type_expr(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and node.value is None:
        return True
    if isinstance(node, ast.Name) and node.id in _TYPE_NAMES:
        return True
    return isinstance(node, ast.Attribute) and node.attr in ("ndarray", "Tensor", "dtype")


def _skipped_subtrees(tree: ast.AST) -> set[int]:
    """ids of nodes whose subtrees are never mutated: docstrings, annotations, f-strings,
    assert and raise statements."""
    skip: set[int] = set()

    def mark(n: ast.AST | None) -> None:
        if n is not None:
            for x in ast.walk(n):
                skip.add(id(x))

    for node in ast.walk(tree):
        if isinstance(node, (ast.Assert, ast.Raise, ast.JoinedStr)):
            mark(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            mark(node.returns)
            for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                mark(a.annotation)
            for a in (node.args.vararg, node.args.kwarg):
                if a is not None:
                    mark(a.annotation)
        elif isinstance(node, ast.AnnAssign):
            mark(node.annotation)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                mark(first)
    return skip


def _bound_names(target: ast.AST) -> list[str] | None:
    """The plain names an assignment target binds; None when it also writes into an
    object (attribute, subscript): removing that is always a candidate."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        names: list[str] = []
        for t in target.elts:
            sub = _bound_names(t.value if isinstance(t, ast.Starred) else t)
            if sub is None:
                return None
            names += sub
        return names
    return None


def _removable(tree: ast.AST) -> set[int]:
    """ids of the statements inside functions whose removal is a realistic bug: call
    statements, augmented assignments, assignments into objects, and assignments that
    rebind a name already bound earlier in the function (removing the first binding of
    a name only raises NameError)."""
    ids: set[int] = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        a = fn.args
        first: dict[str, int] = {x.arg: fn.lineno for x in a.posonlyargs + a.args + a.kwonlyargs}
        for x in (a.vararg, a.kwarg):
            if x is not None:
                first[x.arg] = fn.lineno
        stmts = [n for n in ast.walk(fn) if isinstance(n, ast.stmt) and n is not fn]
        for n in sorted(stmts, key=lambda n: (n.lineno, n.col_offset)):
            targets: list[ast.AST] = []
            if isinstance(n, ast.Assign):
                targets = list(n.targets)
            elif isinstance(n, (ast.AugAssign, ast.AnnAssign, ast.For)):
                targets = [n.target]
            elif isinstance(n, ast.With):
                targets = [i.optional_vars for i in n.items if i.optional_vars is not None]
            names = [_bound_names(t) for t in targets]
            if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call):
                ids.add(id(n))
            elif isinstance(n, ast.AugAssign):
                ids.add(id(n))
            elif isinstance(n, ast.Assign) or (isinstance(n, ast.AnnAssign) and n.value is not None):
                if any(x is None for x in names) or all(first.get(v, n.lineno) < n.lineno
                                                        for x in names for v in x or []):
                    ids.add(id(n))
            for x in names:
                for v in x or []:
                    first.setdefault(v, n.lineno)
    return ids


def generate(module: str, text: str | None = None) -> list[Mutant]:
    """Every mutant of src/attnkit/<module> (deduplicated by resulting source)."""
    if text is None:
        text = (ROOT / PKG / module).read_text()
    src = _Source(text)
    tree = ast.parse(text)
    skip = _skipped_subtrees(tree)
    parents: dict[int, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[id(child)] = node
    removable = _removable(tree)
    out: list[Mutant] = []

    def add(node: ast.AST, kind: str, what: str, a: tuple[int, int], b: tuple[int, int], repl: str) -> None:
        lines = src.lines
        # line: where the change is; cover: the lines whose execution reaches it
        m = Mutant(module, a[0], b[0], kind, what, lines[a[0] - 1].strip(), "", a, b, repl,
                   cover=(min(a[0], node.lineno), max(b[0], node.end_lineno)))  # type: ignore[attr-defined]
        new = m.apply(lines)
        try:
            ast.parse(new)
        except SyntaxError:
            return
        new_lines = new.splitlines()
        m.mutated = new_lines[a[0] - 1].strip() if a[0] - 1 < len(new_lines) else ""
        out.append(m)

    def whole(node: ast.AST) -> tuple[tuple[int, int], tuple[int, int], str]:
        a, b = src.start(node), src.end(node)
        return a, b, src.segment(a, b)

    for node in ast.walk(tree):
        if id(node) in skip or not hasattr(node, "lineno"):
            continue
        if isinstance(node, ast.Compare):
            left = node.left
            for op, right in zip(node.ops, node.comparators):
                sym, new = _CMP[type(op)]
                span = src.find(src.end(left), src.start(right), sym)
                if span:
                    add(node, "compare", f"`{sym}` -> `{new}`", span[0], span[1], new)
                left = right
        elif isinstance(node, ast.BinOp) and type(node.op) in _BIN:
            if isinstance(node.op, (ast.Add, ast.Mult)) and (_is_literal_seq(node.left) or _is_literal_seq(node.right)):
                continue
            if isinstance(node.op, (ast.BitOr, ast.BitAnd)) and (_is_type_expr(node.left) or _is_type_expr(node.right)):
                continue
            if isinstance(node.op, ast.Mod):
                continue
            sym, new = _BIN[type(node.op)]
            span = src.find(src.end(node.left), src.start(node.right), sym)
            if span:
                add(node, "arith", f"`{sym}` -> `{new}`", span[0], span[1], new)
        elif isinstance(node, ast.AugAssign) and type(node.op) in _BIN:
            sym, new = _BIN[type(node.op)]
            span = src.find(src.end(node.target), src.start(node.value), sym + "=")
            if span:
                add(node, "arith", f"`{sym}=` -> `{new}=`", span[0], span[1], new + "=")
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.Invert, ast.USub)):
            sym = {ast.Not: "not", ast.Invert: "~", ast.USub: "-"}[type(node.op)]
            a = src.start(node)
            span = src.find(a, src.start(node.operand), sym)
            if span and span[0] == a:
                kind = "neg" if sym == "-" else "not"
                add(node, kind, f"drop `{sym}`", span[0], src.start(node.operand), "")
        elif isinstance(node, ast.BoolOp):
            sym, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
            for left, right in zip(node.values, node.values[1:]):
                span = src.find(src.end(left), src.start(right), sym)
                if span:
                    add(node, "boolop", f"`{sym}` -> `{new}`", span[0], span[1], new)
        elif isinstance(node, ast.Constant):
            if isinstance(node.value, bool):
                a, b, _ = whole(node)
                add(node, "bool", f"`{node.value}` -> `{not node.value}`", a, b, str(not node.value))
            elif isinstance(node.value, int):
                a, b, _ = whole(node)
                for n in ((1,) if node.value == 0 else (node.value - 1, node.value + 1)):
                    add(node, "int", f"`{node.value}` -> `{n}`", a, b, str(n))
        elif isinstance(node, ast.Attribute) and node.attr == "inf" and isinstance(node.ctx, ast.Load):
            parent = parents.get(id(node))
            if not (isinstance(parent, ast.UnaryOp) and isinstance(parent.op, ast.USub)):
                a, b, seg = whole(node)
                add(node, "inf", f"`{seg}` -> `-{seg}`", a, b, f"(-{seg})")
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id == "float" and len(node.args) == 1 \
                    and isinstance(node.args[0], ast.Constant) and node.args[0].value == "inf":
                parent = parents.get(id(node))
                if not (isinstance(parent, ast.UnaryOp) and isinstance(parent.op, ast.USub)):
                    a, b, seg = whole(node)
                    add(node, "inf", f"`{seg}` -> `-{seg}`", a, b, f"(-{seg})")
            if isinstance(f, ast.Name) and f.id in ("min", "max"):
                a, b, _ = whole(f)
                add(node, "minmax", f"`{f.id}` -> `{_MINMAX[f.id]}`", a, b, _MINMAX[f.id])
            elif isinstance(f, ast.Attribute) and f.attr in _MINMAX:
                e = src.end(f)
                add(node, "minmax", f"`.{f.attr}` -> `.{_MINMAX[f.attr]}`", (e[0], e[1] - len(f.attr)), e,
                    _MINMAX[f.attr])
        # conditions
        test = None
        if isinstance(node, (ast.If, ast.While, ast.IfExp)):
            test = node.test
        if test is not None and id(test) not in skip:
            a, b, seg = whole(test)
            add(test, "cond", "negate the condition", a, b, f"not ({seg})")
        if isinstance(node, ast.comprehension):
            for t in node.ifs:
                a, b, seg = whole(t)
                add(t, "cond", "negate the condition", a, b, f"not ({seg})")
        if id(node) in removable:
            a, b, _ = whole(node)
            add(node, "del", "remove the statement", a, b, "pass")

    seen: set[str] = set()
    unique = []
    count: dict[tuple[str, str, str, int], int] = defaultdict(int)
    for m in sorted(out, key=lambda m: (m.start, m.end, m.what)):
        h = hashlib.sha1(m.apply(src.lines).encode()).hexdigest()
        if h not in seen:
            seen.add(h)
            k = (m.module, m.original, m.what, m.start[1])
            m.ident = hashlib.sha1(repr(k + (count[k],)).encode()).hexdigest()[:10]
            count[k] += 1
            if m.kind == "del":
                m.mutated = f"pass  (removed: {m.original})"
            unique.append(m)
    return unique


# ---- the private copy and the runs ---------------------------------------------------------
_COPY_IGNORE = shutil.ignore_patterns(".venv", ".venv-*", ".git", "site", "out", ".pytest_cache", ".hypothesis",
                                      "*.egg-info", "__pycache__", "*.pyc")

PLUGIN = r'''
"""Per-test line coverage of the mutation targets (sys.settrace on every thread)."""
import json, os, sys, threading
_FILES = set(os.environ["MUTCOV_FILES"].split(os.pathsep))
_OUT = os.environ["MUTCOV_OUT"]
_cur = ["<collect>"]
_hits = {}
_dur = {}
_failed = []
_order = []

_off = []          # set at the end: daemon threads (pool workers) still tracing stop recording

def _local(frame, event, arg):
    if _off:
        return None
    if event == "line":
        _hits.setdefault(_cur[0], set()).add((frame.f_code.co_filename, frame.f_lineno))
    return _local

def _global(frame, event, arg):
    if not _off and frame.f_code.co_filename in _FILES:
        _hits.setdefault(_cur[0], set()).add((frame.f_code.co_filename, frame.f_lineno))
        return _local
    return None

threading.settrace(_global)
sys.settrace(_global)

def pytest_runtest_logstart(nodeid, location):
    _cur[0] = nodeid
    _order.append(nodeid)

def pytest_runtest_logreport(report):
    _dur[report.nodeid] = _dur.get(report.nodeid, 0.0) + report.duration
    if report.failed and report.nodeid not in _failed:
        _failed.append(report.nodeid)

def pytest_runtest_logfinish(nodeid, location):
    _cur[0] = "<between>"

def pytest_unconfigure(config):
    _off.append(True)
    sys.settrace(None)
    threading.settrace(None)
    name = os.environ.get("PYTEST_XDIST_WORKER", "main")
    for _ in range(100):                 # a thread may still add one hit while we copy
        try:
            hits = {t: sorted(set(v)) for t, v in list(_hits.items())}
            break
        except RuntimeError:
            pass
    with open(f"{_OUT}.{name}.json", "w") as f:
        json.dump({"hits": hits, "durations": _dur, "failed": _failed, "order": _order}, f)
'''


class Workspace:
    """``jobs`` private copies of the repository under ``work``: w0, w1, …"""

    def __init__(self, work: Path, jobs: int) -> None:
        self.work = work
        self.dirs = [work / f"w{i}" for i in range(jobs)]
        self.free: queue.Queue = queue.Queue()

    def setup(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        for d in self.dirs:
            if d.exists():
                shutil.rmtree(d)
            shutil.copytree(ROOT, d, ignore=_COPY_IGNORE, symlinks=True)
            (d / ".mutation").mkdir()
            (d / ".mutation" / "mutcov.py").write_text(PLUGIN)
            (d / ".mutation" / "server.py").write_text(SERVER)
            self.free.put(Runner(self, d))

    def env(self, d: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(d / "src"), str(d / ".mutation")]
                                            + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env["PYTHONDONTWRITEBYTECODE"] = "1"     # no stale .pyc between two mutants of one size
        env.pop("PYTEST_ADDOPTS", None)
        env.update(extra or {})
        return env

    def write(self, d: Path, module: str, text: str) -> None:
        path = (d / PKG / module).resolve()
        assert self.work.resolve() in path.parents and ROOT.resolve() not in path.parents, path
        path.write_text(text)


SERVER = r'''
"""A fork server for one private copy: imports the heavy third-party modules once,
then runs each pytest invocation in a fresh fork (attnkit is never imported here, so
every child imports the copy's current, mutated source)."""
import json, os, sys
sys.dont_write_bytecode = True
import pytest
for name in ("numpy", "torch", "numba", "hypothesis", "threadpoolctl", "xdist"):
    try:
        __import__(name)
    except Exception:
        pass
assert not any(m == "attnkit" or m.startswith("attnkit.") for m in sys.modules)
print(json.dumps({"ready": os.getpid()}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.setsid()
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1); os.dup2(fd, 2)
        os.chdir(req["cwd"])
        os.environ.update(req["env"])
        sys.path[:0] = req["path"]
        try:
            rc = int(pytest.main(req["args"]))
        except BaseException as e:
            print(f"pytest.main raised {e!r}")
            rc = 99
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(rc)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)
'''


class Runner:
    """pytest runs in one private copy, through its fork server."""

    def __init__(self, ws: Workspace, d: Path) -> None:
        self.ws, self.d = ws, d
        self.log = d / ".mutation" / "run.log"
        self.proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, str(self.d / ".mutation" / "server.py")], cwd=self.d,
                                         env=self.ws.env(self.d), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True, start_new_session=True)
            assert self.proc.stdout is not None
            json.loads(self.proc.stdout.readline())
        return self.proc

    def _reply(self, proc: subprocess.Popen, timeout: float | None) -> dict | None:
        assert proc.stdout is not None
        import select
        if timeout is not None and not select.select([proc.stdout], [], [], max(timeout, 0))[0]:
            return None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("the fork server died")
        return json.loads(line)

    def pytest(self, args: list[str], timeout: float) -> tuple[str, int, str, float]:
        """(outcome, rc, tail of output, seconds): outcome passed | failed | timeout."""
        proc = self._start()
        assert proc.stdin is not None
        argv = ["-q", "-x", "-p", "no:cacheprovider", "--no-header", "-rf", *args]
        req = {"cwd": str(self.d), "log": str(self.log), "args": argv, "path": [str(self.d / "src")],
               "env": {k: v for k, v in self.ws.env(self.d).items() if k in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}}
        t0 = time.monotonic()
        proc.stdin.write(json.dumps(req) + "\n")
        proc.stdin.flush()
        pid = self._reply(proc, None)["pid"]  # type: ignore[index]
        reply = self._reply(proc, timeout)
        timed_out = reply is None
        if timed_out:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            reply = self._reply(proc, None)
        dt = time.monotonic() - t0
        out = self.log.read_text(errors="replace")
        if timed_out:
            return "timeout", -9, out[-2000:], dt
        rc = reply["rc"]  # type: ignore[index]
        return ("passed" if rc == 0 else "failed"), rc, out[-3000:], dt

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


def _doctest_path(module: str) -> list[str]:
    return [str(PKG / module)] if ">>>" in (ROOT / PKG / module).read_text() else []


def test_set(module: str) -> list[str]:
    return [t for t in TARGETS[module] if (ROOT / t).exists()] + _doctest_path(module)


@dataclass
class Baseline:
    hits: dict[tuple[str, int], list[str]] = field(default_factory=dict)   # (module, line) -> tests
    durations: dict[str, float] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    seconds: float = 0.0


def baseline(ws: Workspace, modules: list[str]) -> Baseline:
    """Run every mapped test file once on the unmutated copy with the coverage plugin."""
    d = ws.dirs[0]
    # test files first: collecting a module's doctests first would import attnkit.merge
    # (the module) over attnkit.merge (the function)
    files = sorted({t for m in modules for t in test_set(m)}, key=lambda t: (t.startswith("src"), t))
    cov = d / ".mutation" / "cov"
    for old in (d / ".mutation").glob("cov.*.json"):
        old.unlink()
    env = ws.env(d, {"MUTCOV_FILES": os.pathsep.join(str((d / PKG / m).resolve()) for m in modules),
                     "MUTCOV_OUT": str(cov)})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "mutcov", "--no-header",
           "-n", "2", *files, *(a for t in DESELECT if t.split("::")[0] in files for a in ("--deselect", t))]
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=d, env=env, capture_output=True, text=True)
    b = Baseline(seconds=time.monotonic() - t0)
    tail = (r.stdout + r.stderr).strip().splitlines()[-1:] or [""]
    print(f"baseline: {len(files)} test files in {b.seconds:.0f} s: {tail[0]}", flush=True)
    prefix = str((d / PKG).resolve()) + os.sep
    hits: dict[tuple[str, int], set[str]] = defaultdict(set)
    for part in sorted((d / ".mutation").glob("cov.*.json")):
        data = json.loads(part.read_text())
        b.durations.update(data["durations"])
        b.failed += [t for t in data["failed"] if t not in b.failed]
        for test, pairs in data["hits"].items():
            if test.startswith("<"):
                continue
            for fname, line in pairs:
                if fname.startswith(prefix):
                    hits[(fname[len(prefix):], line)].add(test)
    b.hits = {k: sorted(v) for k, v in hits.items()}
    if b.failed:
        print(f"baseline: {len(b.failed)} tests fail on the unmutated code and are deselected:", flush=True)
        for t in b.failed:
            print(f"    {t}", flush=True)
    return b


def self_check(ws: Workspace) -> None:
    """Every copy's fork server imports attnkit from that copy, and a deliberate mutant
    there fails its tests while the main tree stays as it was."""
    runners = [ws.free.get() for _ in ws.dirs]
    try:
        for r in runners:
            probe = r.d / ".mutation" / "test_copy.py"
            probe.write_text("import attnkit\n\n\ndef test_the_copy_is_imported():\n"
                             f"    assert attnkit.__file__ == {str((r.d / PKG / '__init__.py').resolve())!r}\n")
            outcome, rc, out, _ = r.pytest([str(probe)], 300)
            assert outcome == "passed", f"attnkit is not imported from the copy {r.d}:\n{out}"
        r = runners[0]
        module = "reference.py"
        original = (r.d / PKG / module).read_text()
        main_before = (ROOT / PKG / module).read_text()
        broken = original.replace("scores = scores * spec.scale\n", "scores = scores * spec.scale * 0.5\n", 1)
        assert broken != original
        ws.write(r.d, module, broken)
        try:
            outcome, rc, out, _ = r.pytest(["tests/test_reference.py"], 300)
        finally:
            ws.write(r.d, module, original)
        assert outcome == "failed", f"a deliberate mutant in the copy was not caught (rc {rc}):\n{out}"
        assert (ROOT / PKG / module).read_text() == main_before
    finally:
        for r in runners:
            ws.free.put(r)
    print(f"self-check: the copies under {ws.work} are imported; a deliberate mutant there fails the tests",
          flush=True)


def run_mutant(ws: Workspace, m: Mutant, base: Baseline, originals: dict[str, str]) -> None:
    runner: Runner = ws.free.get()
    d = runner.d
    try:
        files = test_set(m.module)
        skip = sorted(set(base.failed) | set(DESELECT))
        deselect = [a for t in skip if t.split("::")[0] in files for a in ("--deselect", t)]
        lines = range(m.cover[0], m.cover[1] + 1)
        covering = sorted({t for line in lines for t in base.hits.get((m.module, line), [])},
                          key=lambda t: (t.startswith("src"), base.durations.get(t, 1.0), t))
        covering = [t for t in covering if t.split("::")[0] in files and t not in skip]
        text = m.apply(originals[m.module].splitlines(keepends=True))
        ws.write(d, m.module, text)
        total = 0.0
        stages = ([("covering", covering)] if covering else []) + [("all", files)]
        for stage, args in stages:
            if stage == "covering":
                budget = 30 + 4 * sum(base.durations.get(t, 1.0) for t in covering)
            else:
                budget = 60 + 4 * sum(v for t, v in base.durations.items() if t.split("::")[0] in files)
            outcome, rc, out, dt = runner.pytest(args + deselect, budget)
            total += dt
            if outcome == "timeout":
                m.status, m.detail = "timeout", f"{stage}: no result after {budget:.0f} s"
                break
            if outcome == "failed":
                first = next((ln for ln in out.splitlines() if ln.startswith(("FAILED", "ERROR"))), "")
                crash = rc not in (1,) or "error during collection" in out or "ImportError" in out
                m.status = "crash" if crash and not first.startswith("FAILED") else "killed"
                m.detail = f"{stage}: {first[:200] or out.strip().splitlines()[-1][:200]}"
                break
        else:
            m.status, m.detail = "survived", f"{len(covering)} covering tests, then {len(files)} files"
        m.seconds = total
    finally:
        ws.write(d, m.module, originals[m.module])
        ws.free.put(runner)


# ---- the command -----------------------------------------------------------------------------
def _select(args: argparse.Namespace) -> list[Mutant]:
    modules = args.targets or list(TARGETS)
    for mod in modules:
        if mod not in TARGETS:
            raise SystemExit(f"unknown target {mod!r}; targets: {', '.join(TARGETS)}")
    chosen: list[Mutant] = []
    only: set[str] | None = None
    if args.survivors_of:
        prev = json.loads(Path(args.survivors_of).read_text())
        only = {r["ident"] for r in prev["mutants"] if r["status"] == "survived"}
    for mod in modules:
        ms = generate(mod)
        stale = _stale_equivalents(mod, ms)
        if stale:
            print(f"{mod}: EQUIVALENT entries that match no mutant (their line changed; update or remove "
                  f"them): {stale}", flush=True)
        if only is not None:
            ms = [m for m in ms if m.ident in only]
        if args.kinds:
            ms = [m for m in ms if m.kind in args.kinds]
        if args.lines:
            spans = [(int(lo), int(hi or lo)) for lo, _, hi in (r.partition("-") for r in args.lines.split(","))]
            ms = [m for m in ms if any(lo <= m.line <= hi for lo, hi in spans)]
        total = len(ms)
        if args.max and len(ms) > args.max:
            rng = random.Random(f"{args.seed}:{mod}")
            ms = sorted(rng.sample(ms, args.max), key=lambda m: (m.start, m.what))
        print(f"{mod}: {total} mutants" + (f", {len(ms)} sampled" if len(ms) < total else ""), flush=True)
        chosen += ms
    return chosen


def _stale_equivalents(module: str, mutants: list[Mutant]) -> list[tuple[str, str]]:
    """(line, mutation) of the module's EQUIVALENT entries that none of its mutants
    matches: a listed line that was edited since."""
    used = {m.key for m in mutants} | {(m.module, m.original, f"{m.what} @{m.start[1]}") for m in mutants}
    return [(line, what) for mod, line, what in EQUIVALENT if mod == module and (mod, line, what) not in used]


def _report(mutants: list[Mutant]) -> dict[str, dict[str, int]]:
    table: dict[str, dict[str, int]] = {}
    for m in mutants:
        row = table.setdefault(m.module, defaultdict(int))  # type: ignore[arg-type]
        row[m.status] += 1
        row["mutants"] += 1
    print("\nmodule             mutants  killed  timeout  crash  equiv  survived   kill rate")
    tot: dict[str, int] = defaultdict(int)
    for mod, row in list(table.items()) + [("overall", None)]:  # type: ignore[list-item]
        if row is None:
            row = tot
        else:
            for k, v in row.items():
                tot[k] += v
        dead = row["killed"] + row["timeout"] + row["crash"]
        live = row["mutants"] - row["equivalent"]
        rate = f"{100 * dead / live:6.1f} %" if live else "     -"
        print(f"{mod:20s} {row['mutants']:5d} {row['killed']:7d} {row['timeout']:8d} {row['crash']:6d} "
              f"{row['equivalent']:6d} {row['survived']:9d}   {rate}")
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("targets", nargs="*", help="modules under src/attnkit (default: every target)")
    p.add_argument("--max", type=int, default=0, help="sample at most N mutants per module")
    p.add_argument("--seed", default="0", help="sampling seed")
    p.add_argument("--kinds", nargs="*", help="only these mutation kinds (compare, arith, cond, ...)")
    p.add_argument("--lines", help="only mutants starting on these lines (N, N-M, or several: N-M,K; with one target)")
    p.add_argument("--jobs", type=int, default=2, help="mutants run side by side (one copy each)")
    p.add_argument("--work", type=Path, default=Path("/tmp/mutwork"), help="where the private copies live")
    p.add_argument("--json", type=Path, help="write every result here")
    p.add_argument("--survivors-of", help="rerun only the survivors recorded in this JSON file")
    p.add_argument("--list", action="store_true", help="print the mutants and exit")
    p.add_argument("--resume", action="store_true", help="keep the results already in --json, run the rest")
    p.add_argument("--no-equivalent", action="store_true", help="run mutants listed as equivalent too")
    args = p.parse_args(argv)

    mutants = _select(args)
    if args.list:
        for m in mutants:
            print(f"{PKG / m.module}:{m.line}  [{m.ident}] {m.kind:7s} {m.what:30s} {m.mutated}")
        return 0
    previous: dict[str, dict] = {}
    if args.resume and args.json and args.json.exists():
        previous = {r["ident"]: r for r in json.loads(args.json.read_text())["mutants"] if r["status"]}
    pending = []
    for m in mutants:
        why = equivalent_reason(m)
        if why and not args.no_equivalent:
            m.status, m.detail = "equivalent", why
        elif m.ident in previous and previous[m.ident]["status"] != "equivalent":
            r = previous[m.ident]
            m.status, m.detail, m.seconds = r["status"], r["detail"], r["seconds"]
        else:
            pending.append(m)
    t0 = time.monotonic()
    if pending:
        ws = Workspace(args.work, max(1, args.jobs))
        ws.setup()
        try:
            self_check(ws)
            base = baseline(ws, sorted({m.module for m in pending}))
            _run_all(ws, pending, base, args, mutants, t0)
        finally:
            while not ws.free.empty():
                ws.free.get().close()

    survivors = [m for m in mutants if m.status == "survived"]
    if survivors:
        print(f"\n{len(survivors)} surviving mutants:")
        for m in survivors:
            print(f"  {PKG / m.module}:{m.line}  [{m.ident}] {m.what}\n      - {m.original}\n      + {m.mutated}")
    equivalent = [m for m in mutants if m.status == "equivalent"]
    if equivalent:
        print(f"\n{len(equivalent)} mutants judged equivalent (not run):")
        for m in equivalent:
            print(f"  {PKG / m.module}:{m.line}  {m.what}: {m.mutated}\n      {m.detail}")
    _report(mutants)
    _save(args, mutants, t0)
    return 0


def _save(args: argparse.Namespace, mutants: list[Mutant], t0: float) -> None:
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps({"mutants": [asdict(m) for m in mutants], "seconds": time.monotonic() - t0},
                                  indent=1))
        tmp.replace(args.json)


def _run_all(ws: Workspace, pending: list[Mutant], base: Baseline, args: argparse.Namespace,
             mutants: list[Mutant], t0: float) -> None:
    """The pending mutants on every copy side by side; progress lines, JSON saved as
    it goes."""
    originals = {mod: (ROOT / PKG / mod).read_text() for mod in {m.module for m in pending}}
    work: queue.Queue = queue.Queue()
    for m in pending:
        work.put(m)
    lock = threading.Lock()
    done = [0]

    def worker() -> None:
        while True:
            try:
                m = work.get_nowait()
            except queue.Empty:
                return
            run_mutant(ws, m, base, originals)
            with lock:
                done[0] += 1
                if m.status == "survived" or done[0] % 25 == 0 or done[0] == len(pending):
                    print(f"[{done[0]}/{len(pending)} {time.monotonic() - t0:.0f}s] {m.status:8s} "
                          f"{PKG / m.module}:{m.line} {m.what}: {m.mutated}", flush=True)
                if done[0] % 10 == 0:
                    _save(args, mutants, t0)

    threads = [threading.Thread(target=worker) for _ in ws.dirs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    sys.exit(main())
