"""The text of a :class:`~attnkit.explain.Trace`: every step as a labelled matrix,
one query worked by hand, and a one-line reading — honest about NaN: a row whose
softmax met a NaN or +inf is said to be NaN, with the reason, never shown as a number.

Steps are numbered once each, in the order computed::

    Step 1   scores       Step 2c  alibi      Step 3   weights (and lse)
    Step 2   scaled       Step 2d  excluded   Step 3a  dropped (dropout)
    Step 2a  softcapped   Step 2e  masked     Step 4   out
    Step 2b  biased

>>> STEP_TITLES["alibi"].split()[:3]
['Step', '2c', 'alibi']
"""

from __future__ import annotations

import math
import textwrap

import numpy as np

from .formatting import WIDTH, eq, matrix, num, paren, vec, what_nonfinite, wrap

STEP_TITLES = {
    "scores": "Step 1  scores = q kᵀ: how well each query matches each key",
    "scaled": "Step 2  scaled = scores · scale",
    "softcapped": "Step 2a softcapped = softcap · tanh(scaled / softcap)",
    "biased": "Step 2b biased = scores so far + bias",
    "alibi": "Step 2c alibi = scores so far − slope·|diag(i) − j|: ALiBi's distance penalty",
    "excluded": "Step 2d excluded keys (x): keep / drop / causal / window / lengths / packing",
    "masked": "Step 2e masked = scores with excluded keys set to -inf",
    "weights": "Step 3  weights = softmax over keys: each row sums to 1 (0 if it sees no key)",
    "lse": "        lse = log Σ e^score per query (-inf for a fully masked row)",
    "dropped": "Step 3a dropped = dropout(weights): kept ones ÷ (1 − p), the others 0",
    "out": "Step 4  out = weights v: each output is a blend of the values",
}
SINK_WEIGHTS = "Step 3  weights = softmax over keys and the sink: keys get 1 − the sink's share"
SINK_LSE = "        lse = log(Σ e^score + e^sink) per query"
DROPPED_OUT = "Step 4  out = dropped v: each output is a blend of the values"
NAN_RULE = "attnkit never turns NaN into numbers"
# steps that change the scores (what "then …: scores" lists by hand)
SCORE_MASKS = ("softcap", "bias", "ALiBi", "causal", "window", "keep", "drop", "q_lengths",
               "kv_lengths", "kv_starts", "packed")


def step_title(trace, name) -> str:
    s = trace.spec
    if name == "weights" and s.sinks is not None:
        return SINK_WEIGHTS
    if name == "lse" and s.sinks is not None:
        return SINK_LSE
    if name == "out" and s.dropout > 0:
        return DROPPED_OUT
    if name == "scaled":
        return STEP_TITLES[name] + f" ({scale_text(s)})"
    if name == "dropped":
        return STEP_TITLES[name] + f" (p = {s.dropout:g}, dropout seed {s.seed})"
    return STEP_TITLES[name]


def formula(spec) -> str:
    """The formula with the call's scale: 1/√d_k by default, else the number."""
    if default_scale(spec):
        return "Attention(Q, K, V) = softmax(Q Kᵀ / √d_k) V"
    return f"Attention(Q, K, V) = softmax(Q Kᵀ · {num(spec.scale)}) V"


def default_scale(spec) -> bool:
    return spec.scale == 1.0 / math.sqrt(spec.D)


def scale_text(spec) -> str:
    if default_scale(spec):
        return f"1/√{spec.D} {eq(spec.scale)} {num(spec.scale)}"
    return num(spec.scale)


# ---- the whole trace -------------------------------------------------------------------
def render(trace, width: int = WIDTH, max_blocks: int = 2) -> str:
    """See :meth:`Trace.render`."""
    s = trace.spec
    lines = [formula(s), ""]
    lines += wrap([f"q {s.shapes['q']}", f"k {s.shapes['k']}", f"v {s.shapes['v']}",
                   f"scale {scale_text(s)}",
                   "masks: " + (", ".join(trace.masks) if trace.masks else "none")],
                  width, sep=";  ")
    for note in notes(trace):
        lines += wrap([note], width)
    blocks = trace.blocks()
    small = s.S <= 6 and s.D <= 4 and s.Dv <= 4
    single = len(blocks) == 1
    if single:
        q, k, v = trace.inputs(blocks[0])
        lines.append("")
        lines += matrix("q", q, trace.query_labels, [f"d{j}" for j in range(s.D)], width)
        lines += matrix("k", k, trace.labels, [f"d{j}" for j in range(s.D)], width)
        lines += matrix("v", v, trace.labels, [f"d{j}" for j in range(s.Dv)], width)
    if small:
        lines.append("")
        who = trace.query_labels[0]
        head = f" ({trace.block_name(blocks[0])})" if blocks[0] else ""
        if s.L > 1 or not single:
            lines.append(f"Query {who}{head}, worked by hand:")
        lines += arithmetic(trace, blocks[0], 0, width)
    if s.L > 1 or not single or not small:
        for b in blocks[:max_blocks]:
            lines.append("")
            if b:
                lines.append(f"== {trace.block_name(b)} ==")
            lines += steps_text(trace, b, width)
        if len(blocks) > max_blocks:
            lines.append("")
            lines.append(f"... {len(blocks) - max_blocks} more heads not shown "
                         "(use --json or the Trace for all)")
    lines.append("")
    lines += reading(trace, blocks[0], 0, width)
    return "\n".join(lines)


def notes(trace) -> list[str]:
    """One sentence each for packing, sinks, dropout and NaN rows, under the header."""
    s = trace.spec
    out = []
    seqs = trace.sequences()
    if seqs:
        def span(names, a, b):
            return "none" if a == b else (names[a] if b - a == 1 else f"{names[a]}–{names[b - 1]}")
        parts = [f"{span(trace.query_labels, q0, q1)} see {span(trace.labels, k0, k1)}"
                 for q0, q1, k0, k1 in seqs]
        out.append(f"packed: {len(seqs)} sequences side by side ({'; '.join(parts)}); a query "
                   "never sees another sequence's keys, so the excluded keys form blocks "
                   "along the diagonal.")
    if s.sinks is not None:
        out.append("sinks: one extra logit per query row (the sink's score; its value vector is "
                   "0); it joins the softmax's total only, so each row's key weights sum to less "
                   "than 1 and the rest goes to the sink: column 'sink' in Step 3.")
    if s.dropout > 0:
        out.append(f"dropout: after the softmax each weight is kept with probability "
                   f"{1 - s.dropout:g} and divided by {1 - s.dropout:g}, or set to 0 (Step 3a). "
                   f"Which ones is decided by the dropout seed {s.seed} (a random seed: the same "
                   "seed drops the same weights).")
    nan_rows = int(np.isnan(trace.out).any(axis=-1).sum())
    if nan_rows:
        out.append(f"NaN: {nan_rows} query row{'s are' if nan_rows != 1 else ' is'} NaN because "
                   "a non-finite value, NaN or inf in the inputs or a score that overflowed, "
                   f"reached {'their' if nan_rows != 1 else 'its'} softmax or weighted sum; "
                   f"{NAN_RULE}.")
    return out


def steps_text(trace, b, width) -> list[str]:
    """Every step of block ``b`` as a labelled matrix."""
    s = trace.spec
    keys, queries = trace.labels, trace.query_labels
    lines = []
    for name, arr in trace.items():
        x = trace.pick(arr, b)
        lines += textwrap.wrap(step_title(trace, name), width, subsequent_indent=" " * 8,
                               break_long_words=False)
        if name == "excluded":
            lines += matrix("", np.where(x, "x", "·"), queries, keys, width)
        elif name == "lse":
            lines += matrix("", x[:, None], queries, ["lse"], width)
        elif name == "out":
            lines += matrix("", x, queries, [f"d{j}" for j in range(s.Dv)], width)
        elif name == "weights" and s.sinks is not None:
            sink = trace.pick(trace.sink_weights, b)
            lines += matrix("", np.concatenate([x, sink[:, None]], axis=1), queries, keys + ["sink"], width)
        elif name == "alibi":
            lines.append("  the penalty −slope · |diag(i) − j| (0 on the diagonal):")
            lines += matrix("", trace.pick(trace.alibi_penalty, b), queries, keys, width)
            lines.append("  the scores with it added:")
            lines += matrix("", x, queries, keys, width)
        else:
            lines += matrix("", x, queries, keys, width)
    return lines


# ---- one query row ----------------------------------------------------------------------
def _row(trace, b, row):
    """name -> this row's values, for the steps and derived arrays of the trace."""
    def get(x):
        return None if x is None else trace.pick(x, b)[row]
    r = {name: get(x) for name, x in trace.items()}
    r.update(final=get(trace.final_scores), used=get(trace.used_weights),
             sink=get(trace.sink_weights), sink_logit=get(trace.sink_logits))
    return r


def row_status(trace, b=(), row: int = 0) -> str:
    """'padding', 'nan' (a NaN or +inf reached the softmax), 'excluded' (every key),
    'nan_out' (the weights are numbers but the output is not) or 'ok'."""
    r = _row(trace, b, row)
    if trace.padding(b)[row]:
        return "padding"
    f, w = r["final"], r["weights"]
    if np.isnan(f).any() or np.isposinf(f).any() or np.isnan(w).any():
        return "nan"
    if np.isneginf(f).all():
        return "excluded"
    if not np.isfinite(r["out"]).all():
        return "nan_out"
    return "ok"


def nan_reasons(trace, b=(), row: int = 0) -> list[str]:
    """Why query ``row``'s softmax (or output) is not a number, one phrase per cause."""
    s = trace.spec
    r = _row(trace, b, row)
    q, k, v = trace.inputs(b)
    who, keys = trace.query_labels[row], trace.labels
    reasons = []
    if not np.isfinite(q[row]).all():
        reasons.append(f"{who} holds {what_nonfinite(q[row])}")
    bad = np.flatnonzero(np.isnan(r["final"]) | np.isposinf(r["final"]))
    order = [n for n in ("scores", "scaled", "softcapped", "biased", "alibi") if n in r]
    dtype = trace["scores"].dtype.name
    for j in bad[:3]:
        key = keys[j]
        if not np.isfinite(k[j]).all():
            reasons.append(f"key {key} holds {what_nonfinite(k[j])}")
            continue
        if not np.isfinite(q[row]).all():
            continue
        step = next((n for n in order if np.isnan(r[n][j]) or np.isposinf(r[n][j])), None)
        val = num(r[step][j]) if step else num(r["final"][j])
        if step == "scores":
            big = f"{np.finfo(dtype).max:.3g}"
            reasons.append(f"{who}·{key} overflowed to inf, past {dtype}'s largest number {big}"
                           if val == "inf" else
                           f"{who}·{key} overflowed: its products pass {dtype}'s largest number "
                           f"{big} both ways, and inf − inf is NaN")
        elif step == "scaled":
            reasons.append(f"scaling {who}·{key} by {num(s.scale)} overflowed to {val}")
        elif step == "biased":
            reasons.append(f"the bias makes the score of {key} {val}")
        elif step == "alibi":
            reasons.append(f"the ALiBi term makes the score of {key} {val}")
        else:
            reasons.append(f"the score of {key} is {val}")
    if len(bad) > 3:
        reasons.append(f"and {len(bad) - 3} more keys")
    if r["sink_logit"] is not None and not np.isfinite(r["sink_logit"]):
        reasons.append(f"its sink logit is {num(r['sink_logit'])}")
    if not reasons:
        visible = r["final"] != -np.inf
        vbad = [keys[j] for j in np.flatnonzero(visible) if not np.isfinite(v[j]).all()]
        if vbad:
            reasons.append(f"the value{'s' if len(vbad) > 1 else ''} of {', '.join(vbad[:3])} "
                           f"{'hold' if len(vbad) > 1 else 'holds'} NaN or inf and "
                           f"{'are' if len(vbad) > 1 else 'is'} not excluded: a non-finite value "
                           "is never multiplied away, not even by a weight of 0")
        else:
            reasons.append("a non-finite value reached it")
    return reasons


def arithmetic(trace, b=(), row: int = 0, width: int = WIDTH) -> list[str]:
    """See :meth:`Trace.arithmetic`."""
    s = trace.spec
    q, k, v = trace.inputs(b)
    r = _row(trace, b, row)
    dots, scaled, w, out, final, used = (r[n] for n in ("scores", "scaled", "weights", "out", "final", "used"))
    keys = trace.labels
    pad = max(len(x) for x in keys)
    qname = trace.query_labels[row]
    L = ["Step 1  dot products q·k: how well the query matches each key"]
    for j, key in enumerate(keys):
        terms = [f"{paren(a)}·{paren(c)}" for a, c in zip(q[row], k[j])]
        terms = [t + " +" for t in terms[:-1]] + [f"{terms[-1]} {eq(dots[j])} {num(dots[j])}"]
        L += wrap(terms, width, indent=8, first=f"{qname}·{key:<{pad}} = ")
    if default_scale(s):
        root = math.sqrt(s.D)
        L.append(f"Step 2  divide by √d_k = √{s.D} {eq(root)} {num(root)} "
                 "(keeps the softmax from saturating)")
        parts = [f"{num(d)} / {num(root)} {eq(x)} {num(x)}" for d, x in zip(dots, scaled)]
    else:
        L.append(f"Step 2  multiply by scale = {num(s.scale)}")
        parts = [f"{num(d)} · {num(s.scale)} {eq(x)} {num(x)}" for d, x in zip(dots, scaled)]
    L += wrap(parts, width, indent=8, sep="      ")
    changed = [m for m in trace.masks if m.split()[0] in SCORE_MASKS]
    if changed:
        L += wrap([f"then {', '.join(changed)}:"], width, indent=8)
        L += wrap([num(x) for x in final], width, indent=8, sep=", ", first="scores ")
    status = row_status(trace, b, row)
    if status == "nan":
        L.append("Step 3  softmax: weight = e^score / total")
        L += wrap([f"{qname}'s row is NaN because a non-finite value reached its softmax: "
                   f"{'; '.join(nan_reasons(trace, b, row))}. A softmax over NaN or inf has no "
                   f"value (inf / inf is NaN) and {NAN_RULE}, so every weight of the row is NaN."], width, indent=8)
        L += wrap([f"{key} {num(w[j])}" for j, key in enumerate(keys)], width, indent=8,
                  sep=", ", first="weights: ")
        L.append("Step 4  output = Σ weight · value")
        L.append(f"        = {vec(out, 2)}: NaN, like the weights")
        return L
    if status == "padding":
        L.append("Step 3  this query row is padding (beyond q_lengths): weights 0, lse -inf")
        L.append(f"Step 4  output = {vec(out, 2)}")
        return L
    top = np.max(final[np.isfinite(final)]) if np.isfinite(final).any() else 0.0
    sink = r["sink_logit"]
    if sink is not None:
        top = max(top, float(sink))
    shift = top if top > 20 else 0.0
    e = np.exp(final - shift)                      # display only: the weights below come from the trace
    sink_line = sink is not None
    L.append("Step 3  softmax: weight = e^score / total" + ("" if sink_line else " (the weights sum to 1)"))
    if sink_line:
        L.append("        (the total includes e^sink, so the keys' weights sum to 1 − the sink's)")
    if shift:
        L.append(f"        (subtracting the largest score m = {num(shift)} first: "
                 "same weights, no overflow)")
    expo = (lambda x: f"e^({num(x)} − m)") if shift else (lambda x: f"e^{paren(x)}")
    ex = None if trace.excluded is None else trace.pick(trace.excluded, b)[row]

    def zero(j):                                   # why key j's e^score is 0
        if ex is not None and ex[j]:
            return "excluded"
        if dots[j] == -np.inf and np.isfinite(q[row]).all() and np.isfinite(k[j]).all():
            return f"{qname}·{keys[j]} overflowed to -inf, read as an excluded key"
        return "score -inf"
    parts = [f"{expo(x)} {eq(y)} {num(y)}" if np.isfinite(x) else f"{expo(x)} = 0 ({zero(j)})"
             for j, (x, y) in enumerate(zip(final, e))]
    total = e.sum()
    if sink_line:
        es = math.exp(float(sink) - shift)
        parts.append(f"sink {expo(sink)} {eq(es)} {num(es)}")
        total += es
    L += wrap(parts + [f"total {num(total)}"], width, indent=8, sep="   ")
    wparts = [f"{key} {w[j]:.3f}" for j, key in enumerate(keys)]
    if sink_line:
        wparts.append(f"sink {r['sink']:.3f}")
    L += wrap(wparts, width, indent=8, sep=", ", first="weights: ")
    if s.dropout > 0:
        keep = 1 - s.dropout
        L.append(f"Step 3a dropout p = {s.dropout:g} (dropout seed {s.seed}): kept weights ÷ {keep:g}, "
                 "the others 0")
        L += wrap([f"{key} {used[j]:.3f}" if used[j] or not w[j] else f"{key} 0 (dropped)"
                   for j, key in enumerate(keys)], width, indent=8, sep=", ", first="weights: ")
    terms = [f"{used[j]:.3f}·{vec(v[j])}" for j in range(s.S) if used[j] > 0]
    L.append("Step 4  output = Σ weight · value")
    if status == "nan_out":
        L += wrap([f"= {vec(out, 2)}: NaN, because {'; '.join(nan_reasons(trace, b, row))}."],
                  width, indent=8)
    elif status == "excluded":
        L.append(f"        every key is excluded, so the output is {vec(out, 2)} (not NaN)")
    elif not terms:
        cause = "dropout dropped every weight" if s.dropout > 0 and w.any() else \
            "the sink takes all the weight"
        L.append(f"        {cause}, so the output is {vec(out, 2)}")
    else:
        L += wrap([" + ".join(terms) + f" = {vec(out, 2)}"], width, indent=8)
    return L


def reading(trace, b=(), row: int = 0, width: int = WIDTH) -> list[str]:
    """See :meth:`Trace.reading`."""
    r = _row(trace, b, row)
    w = r["weights"]
    _, _, v = trace.inputs(b)
    who = trace.query_labels[row]
    status = row_status(trace, b, row)
    if status == "padding":
        text = (f"Reading: {who} is a padding row (beyond q_lengths), so its output is 0 "
                "(weights 0, lse -inf).")
    elif status == "nan":
        text = (f"Reading: {who}'s output is NaN because a non-finite value reached its softmax "
                f"({'; '.join(nan_reasons(trace, b, row))}); {NAN_RULE}.")
    elif status == "nan_out":
        text = f"Reading: {who}'s output is NaN because {'; '.join(nan_reasons(trace, b, row))}."
    elif status == "excluded":
        lse = "lse = the sink logit" if r["sink"] is not None else "lse -inf"
        text = (f"Reading: every key is excluded for {who}, so its output is 0 "
                f"(weights 0, {lse}), never NaN.")
    else:
        j = int(np.argmax(w))
        key = trace.labels[j]
        tied = [trace.labels[i] for i in np.flatnonzero(w == w[j])]
        if w[j] == 1 and r["sink"] is None:
            text = (f"Reading: {who} sees {key} alone (weight 1), so its output is {key}'s "
                    f"value {vec(v[j])}.")
        elif w[j] > 0.995:
            text = (f"Reading: {who} sees {key} almost alone (weight {w[j]:.3f}), so its "
                    f"output is close to {key}'s value {vec(v[j])}.")
        elif w[j] == 0:
            text = f"Reading: the sink takes all of {who}'s weight, so its output is 0."
        elif len(tied) > 1:
            shown = ", ".join(tied[:3]) + (f" and {len(tied) - 3} more" if len(tied) > 3 else "")
            text = (f"Reading: {who} weighs {shown} equally ({w[j]:.1%} each), so its output "
                    "is a blend of the values, not a copy.")
        else:
            text = (f"Reading: {who} weighs {key} most ({w[j]:.1%}), so its output leans "
                    f"toward {key}'s value {vec(v[j])}: a blend of the values, not a copy.")
        if r["sink"] is not None and r["sink"] > 0.005 and w[j] > 0:
            text += (f" The sink takes {r['sink']:.0%} of the weight, which shrinks the "
                     "output toward 0.")
        if trace.spec.dropout > 0:
            text += " Dropout then changed the weights (Step 3a), and the output with them."
    return wrap([text], width)
