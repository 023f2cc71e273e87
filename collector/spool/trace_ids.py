"""A trajectory id as a user types it: the viewer's short form, a unique prefix, or one sampled out.

The viewer shows ids as ``…000000e7`` (their last characters); a user copies that, or the first
characters of an id, into ``tracecar show`` / ``tracecar tokens``. :func:`resolve` answers the
full id when exactly one trajectory matches, in the store or in the sampling decisions, and
otherwise why not: several match (name them), or the trajectory was sampled out (its decision:
the rule or limit, experiment and step), or nothing matches. Only asked after an exact id missed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .store import Spool

MIN_CHARS = 4  # a shorter fragment matches too much to mean one trajectory
SHOWN = 5  # candidates named when several match
ELLIPSES = ("…", "...")


@dataclass
class Resolution:
    """``trace_id`` when one stored trajectory matches; else ``reason`` (one sentence) and what is known."""

    trace_id: str | None = None
    reason: str = ""
    candidates: list[str] = field(default_factory=list)
    decision: dict[str, Any] | None = None


def _like(fragment: str) -> str:
    return fragment.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def _matches(spool: Spool, fragment: str, suffix: bool) -> list[str]:
    """Trajectory ids in the store or the decisions that end with (``suffix``: a scan of the trace-id
    index) or start with ``fragment`` (a range of it)."""
    if suffix:
        where, params = "trace_id LIKE ? ESCAPE '\\'", ["%" + _like(fragment)]
    else:
        where, params = "trace_id >= ? AND trace_id < ?", [fragment, fragment + "\U0010ffff"]
    found: list[str] = []
    for table in ("spans", "trajectory_decisions", "trace_decisions"):
        rows = spool.query(f"SELECT DISTINCT trace_id FROM {table} WHERE {where} LIMIT ?", [*params, SHOWN + 1])
        found.extend(r["trace_id"] for r in rows if r["trace_id"] not in found)
    if spool.archive is not None and len(found) <= SHOWN:  # and those retention moved to the archive (spool/archive.py)
        found.extend(t for t in spool.archive.trace_ids_matching(fragment, suffix, SHOWN + 1) if t not in found)
    return found


def sampling_decision(spool: Spool, trace_id: str) -> dict[str, Any] | None:
    """The decision that dropped this trajectory, if a budget did (tail: with its reason; head: the sample's)."""
    rows = spool.query("SELECT experiment, validate, step, sample_index, rollout_n, keep, rule, reason, worker"
                       " FROM trajectory_decisions WHERE trace_id = ?", [trace_id])
    if rows:
        return {**rows[0], "mode": "tail", "keep": bool(rows[0]["keep"])}
    rows = spool.query("SELECT keep FROM trace_decisions WHERE trace_id = ?", [trace_id])
    if rows:
        return {"mode": "head", "keep": bool(rows[0]["keep"]), "reason": "max_samples_per_step_per_worker"}
    return None


def describe_decision(trace_id: str, decision: dict[str, Any]) -> str:
    if decision["mode"] == "head":
        return (f"trajectory {trace_id} was sampled out by the head budget (max_samples_per_step_per_worker): its "
                "sample index was not among those kept for its worker and step")
    where = ", ".join(f"{k} {decision[k]!r}" if k == "experiment" else f"{k} {decision[k]}"
                      for k in ("experiment", "step", "sample_index", "rollout_n") if decision.get(k) is not None)
    experiment = f" --experiment {decision['experiment']}" if decision.get("experiment") is not None else ""
    return (f"trajectory {trace_id} was sampled out ({decision.get('reason')}) at {where}: see "
            f"tracecar decisions --step {decision.get('step')}{experiment}")


def resolve(spool: Spool, text: str) -> Resolution:
    """What ``text`` names, asked after it missed as an exact id."""
    decision = sampling_decision(spool, text)
    if decision is not None and not decision["keep"]:
        return Resolution(reason=describe_decision(text, decision), decision=decision)
    fragment, suffix = text.strip(), False
    for mark in ELLIPSES:
        if fragment.startswith(mark):
            fragment, suffix = fragment[len(mark):], True
            break
    if len(fragment) < MIN_CHARS:
        return Resolution(reason=f"no trajectory {text!r} in the store: give a full id, its viewer form ('…' and its last "
                                 f"characters) or a prefix, of {MIN_CHARS} characters at least")
    matches = _matches(spool, fragment, suffix)
    if len(matches) > 1:
        named = ", ".join(matches[:SHOWN]) + (", …" if len(matches) > SHOWN else "")
        return Resolution(reason=f"{text!r} matches {'more than ' + str(SHOWN) if len(matches) > SHOWN else len(matches)} "
                                 f"trajectories ({named}): give more characters", candidates=matches[:SHOWN])
    if not matches:
        return Resolution(reason=f"no trajectory {text!r} in the store (nor in the sampling decisions)")
    full = matches[0]
    decision = sampling_decision(spool, full)
    if decision is not None and not decision["keep"]:
        return Resolution(reason=describe_decision(full, decision), decision=decision, candidates=[full])
    if not spool.query("SELECT 1 FROM spans WHERE trace_id = ? LIMIT 1", [full]) and not (
            spool.may_be_archived(full) and spool.archive is not None and spool.archive.spans_of([full])):
        return Resolution(reason=f"trajectory {full} is no longer in the store (evicted or deleted after forwarding)",
                          candidates=[full])
    return Resolution(trace_id=full)
