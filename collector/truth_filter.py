"""The truth filters of the trajectory list: ``drift=`` and ``where=acc=0,format<1`` (issue 29).

SQL over the viewer index's ``trajectories`` (trajectory_filter.py joins it to the other
filters), reading the truth tables viewer/truth.py keeps beside it; each is a ``trace_id IN
(subquery)`` that seeks its own index (``truth_drift``, ``reward_components_kv``).
"""

from __future__ import annotations

import re
from typing import Any

_CONDITION = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_.:/-]{0,63})\s*(<=|>=|!=|==|=|<|>)\s*(\S+)\s*$")
_OPS = {"=": "=", "==": "=", "!=": "!=", "<": "<", "<=": "<=", ">": ">", ">=": ">="}


def parse_where(text: str) -> list[tuple[str, str, float]]:
    """``"acc=0, format<1"`` as ``[("acc", "=", 0.0), ("format", "<", 1.0)]``; ValueError says what is wrong."""
    out = []
    for part in text.split(","):
        if not part.strip():
            continue
        match = _CONDITION.match(part)
        if match is None:
            raise ValueError(f"{part.strip()[:64]!r} is not KEY OP NUMBER (OP one of = != < <= > >=), e.g. acc=0,format<1")
        key, op, raw = match.groups()
        value = {"true": 1.0, "false": 0.0}.get(raw.lower())
        if value is None:
            try:
                value = float(raw)
            except ValueError:
                raise ValueError(f"{raw[:64]!r} in {part.strip()[:64]!r} is not a number (or true/false)") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"{raw[:64]!r} must be a finite number")
        out.append((key, _OPS[op], value))
    if len(out) > 16:
        raise ValueError("at most 16 conditions")
    return out


FATES = ("trained", "filtered", "evicted", "not_reached")
_NOTED = "trace_id IN (SELECT trace_id FROM truth WHERE fate = ?)"
_ROWED = "trace_id IN (SELECT trace_id FROM truth WHERE tt_mismatch IS NOT NULL)"
_EVICTED = "trace_id NOT IN (SELECT trace_id FROM truth WHERE fate = 'evicted')"
FATE_CLAUSES = {  # as viewer/truth.py's fate_of decides it: evicted over trained over filtered
    "evicted": ("trace_id IN (SELECT trace_id FROM truth WHERE fate = 'evicted')", []),
    # a trainer row (trainer_tokens) says it was trained on too
    "trained": (f"(trained = 1 OR {_NOTED} OR {_ROWED}) AND {_EVICTED}", ["trained"]),
    "filtered": (f"(trained = 0 OR {_NOTED}) AND NOT (COALESCE(trained, 0) = 1 OR {_NOTED} OR {_ROWED}) AND {_EVICTED}",
                 ["filtered", "trained"]),
    "not_reached": ("trained IS NULL AND trace_id NOT IN (SELECT trace_id FROM truth WHERE fate IS NOT NULL"
                    " OR tt_mismatch IS NOT NULL)", []),
}


def where_clauses(drift: bool | None, where: str | None, fate: str | None = None, refill: bool | None = None,
                  trained_other: bool | None = None, lp_delta_min: float | None = None) -> tuple[list[str], list[Any]]:
    """SQL over the index's ``trajectories`` for the truth filters (trajectory_filter.py calls it)."""
    clauses: list[str] = []
    params: list[Any] = []
    if trained_other is True:  # the trainer trained on other tokens than the rollout generated
        clauses.append("trace_id IN (SELECT trace_id FROM truth WHERE tt_mismatch = 1)")
    elif trained_other is False:
        clauses.append("trace_id IN (SELECT trace_id FROM truth WHERE tt_mismatch = 0)")
    if lp_delta_min is not None:
        clauses.append("trace_id IN (SELECT trace_id FROM truth WHERE lp_max >= ?)")
        params.append(lp_delta_min)
    if fate:
        clause, values = FATE_CLAUSES[fate]
        clauses.append(clause)
        params.extend(values)
    if refill is not None:
        clauses.append(("" if refill else "NOT ") + "trace_id IN (SELECT trace_id FROM truth WHERE refill_of IS NOT NULL)")
    if drift is True:
        clauses.append("trace_id IN (SELECT trace_id FROM truth WHERE drift_turns > 0)")
    elif drift is False:
        clauses.append("trace_id IN (SELECT trace_id FROM truth WHERE drift_checked > 0 AND drift_turns = 0)")
    for key, op, value in parse_where(where) if where else ():
        clauses.append(f"trace_id IN (SELECT trace_id FROM reward_components WHERE key = ? AND value {op} ?)")
        params.extend((key, value))
    return clauses, params
