"""The one trajectory filter: every list of trajectories builds its WHERE clause here.

``GET /v1/trajectories`` (and ``tracecar trajectories``), the viewer's ``/ui/api/trajectories``,
``q=`` text search, ``/v1/export``, ``/v1/groups`` and the live view (``/v1/live``) take the same
filters. Each used to build its own WHERE clause, and they drifted apart: ``experiment=""`` meant
"sent without an experiment name" on the viewer and live paths but a literal empty name in the
SQL list. Now one dataclass says what each filter means, as SQL over any table whose columns
carry the filters' names (the viewer index's ``trajectories``, the spool's ``spans``), and as a
Python predicate for rows that live outside SQLite (the live view's open-call markers).

Meanings, the same on every path:

* ``experiment=""`` is the trajectories sent without an experiment name (``IS NULL``);
* any other blank text filter (``worker``, ``kept_because``, ``filtered_by``, ``sample_index``,
  ``q``, ``reward_where``) is no filter at all, as the viewer's empty fields send;
* ``sample_index`` matches the int and the string spelling of a number (VERL sends either);
* ``q``: every word must occur in the first prompt or the last response (viewer/search.py);
* ``attributes``: (key, value) pairs the root span's attributes must hold (``attr=key=value``, repeated or
  ``;``-separated,
  ``attributes.`` optional, a dotted key reaches into a mapping); the value is compared as text
  (``0.7``, ``true``, ``calc``). Answered over the viewer index only (it reads the root's stored
  payload: narrow the list with experiment and step on a large store).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, fields
from typing import Any

from . import text_query, truth_filter

TEXT_EQUALS = ("worker", "kept_because", "filtered_by", "node")
INT_EQUALS = ("step", "rollout_n")
FLAGS = ("validate", "has_error", "trained")
RANGES = (("step_min", "step", ">="), ("step_max", "step", "<="),
          ("reward_min", "reward", ">="), ("reward_max", "reward", "<="))


def sample_index_values(value: int | str) -> list[int | str]:
    """What a ``sample_index`` filter matches: VERL's index is an int or a string, and a query
    parameter is always a string, so ``"7"`` matches both the int 7 and the string ``"7"``."""
    if type(value) is int:
        return [value, str(value)]
    text = str(value)
    try:
        number = int(text)
    except ValueError:
        return [text]
    return [number, text] if str(number) == text and -(2**63) <= number < 2**63 else [text]


@dataclass
class TrajectoryFilter:
    """Every filter optional (``None``: not filtered). Field order is the viewer routes' positional order."""

    experiment: str | None = None  # "" = the trajectories sent without an experiment name
    step: int | None = None
    step_min: int | None = None
    step_max: int | None = None
    sample_index: int | str | None = None  # an int, or a string index when the client sends one
    rollout_n: int | None = None
    validate: bool | None = None
    kept_because: str | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    has_error: bool | None = None
    worker: str | None = None
    trained: bool | None = None  # what the trainer did (client.annotate(trained=...))
    filtered_by: str | None = None
    node: str | None = None  # on a gateway: the node collector that forwarded the trajectory
    q: str | None = None  # words searched in the first prompt and last response (viewer/search.py)
    attributes: tuple[tuple[str, str], ...] | None = None  # the root's attributes: ((key, value as text), ...)
    # training truth (issue 29; truth_filter.py): only over the viewer index's trajectories
    drift: bool | None = None  # a turn whose prompt does not extend the previous turn's prompt + response
    reward_where: str | None = None  # reward components, e.g. "acc=0,format<1" (the query's where=)
    fate: str | None = None  # trained, filtered, evicted, not_reached (truth_filter.FATES)
    refill: bool | None = None  # a group that replaces an evicted one
    trained_other: bool | None = None  # the trainer trained on other tokens than generated (ids or mask)
    lp_delta_min: float | None = None  # |Δ logprob| rollout vs trainer reaches this on some token

    def active(self) -> set[str]:
        """The filters that constrain (blank text is no filter, except ``experiment``)."""
        return {f.name for f in fields(self) if _set(f.name, getattr(self, f.name))}

    def where(self, allowed: Collection[str] | None = None) -> tuple[str, list[Any]]:
        """``(clauses joined by AND, params)`` over a table with these column names; ``""`` when nothing filters.

        ``allowed``: the filters the caller's table can answer; another one set is a programming
        error (a filter silently ignored would list what the user excluded).
        """
        if allowed is not None and self.active() - set(allowed):
            raise ValueError(f"filters not supported here: {sorted(self.active() - set(allowed))}")
        clauses: list[str] = []
        params: list[Any] = []
        if self.experiment == "":
            clauses.append("experiment IS NULL")
        elif self.experiment is not None:
            clauses.append("experiment = ?")
            params.append(self.experiment)
        for name in (*INT_EQUALS, *TEXT_EQUALS):
            value = getattr(self, name)
            if _set(name, value):
                clauses.append(f"{name} = ?")
                params.append(value)
        if _set("sample_index", self.sample_index):
            assert self.sample_index is not None
            values = sample_index_values(self.sample_index)
            clauses.append(f"sample_index IN ({','.join('?' * len(values))})")
            params.extend(values)
        for name, column, op in RANGES:
            value = getattr(self, name)
            if value is not None:
                clauses.append(f"{column} {op} ?")
                params.append(value)
        for name in FLAGS:
            value = getattr(self, name)
            if value is not None:
                clauses.append(f"{name} = ?")
                params.append(int(value))
        for key, value in self.attributes or ():
            clauses.append(ATTRIBUTE_CLAUSE)
            params.extend([key, value])
        truth, truth_params = truth_filter.where_clauses(self.drift, self.reward_where or None, self.fate or None, self.refill,
                                                            self.trained_other, self.lp_delta_min)
        clauses.extend(truth)
        params.extend(truth_params)
        match = text_query.fts_query(self.q) if self.q else None
        if match is not None:
            clauses.append(text_query.MATCH_CLAUSE)
            params.append(match)
        return " AND ".join(clauses), params

    def matches(self, row: Mapping[str, Any], unknown_passes: Collection[str] = ()) -> bool:
        """The same filters on a row held in memory (``q`` excepted: it needs the text index).

        ``unknown_passes``: columns whose ``None`` in the row passes any filter on them (a live
        call's marker may not carry ``validate``).
        """
        active = self.active()
        if "q" in active or "attributes" in active or active & {"drift", "reward_where", "fate", "refill", "trained_other", "lp_delta_min"}:
            raise ValueError("q=, attr=, drift= and where= need the trajectory index or the stored trajectories; filter in SQL")
        for name in active:
            value = getattr(self, name)
            column = next((c for n, c, _ in RANGES if n == name), name)
            have = row.get(column)
            if have is None and column in unknown_passes:
                continue
            if name == "experiment":
                ok = have == (value or None)
            elif name == "sample_index":
                ok = have in sample_index_values(value)
            elif name in FLAGS:
                ok = have is not None and bool(have) == value
            elif name in ("step_min", "reward_min"):
                ok = have is not None and have >= value
            elif name in ("step_max", "reward_max"):
                ok = have is not None and have <= value
            else:
                ok = have == value
            if not ok:
                return False
        return True

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def _set(name: str, value: Any) -> bool:
    if value is None:
        return False
    return name == "experiment" or (value != "" and value != ())


MAX_ATTRIBUTE_FILTERS = 4
_KEY = re.compile(r"[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*")
# the root's attribute (as text: true/false/null spelt so) equal to the value, over the viewer index's rows: its
# root_attributes table (viewer/root_attributes.py), written when the root is indexed
ATTRIBUTE_CLAUSE = "rowid IN (SELECT traj FROM root_attributes WHERE key = ? AND value = ?)"


def parse_attribute_filters(raw: list[str] | None) -> tuple[tuple[str, str], ...] | None:
    """``key=value`` (or ``attributes.key=value``) strings as pairs; ValueError names what is wrong."""
    pairs = []
    for item in (part for given in raw or () for part in given.split(";") if part.strip()):  # "k=v; k2=v2" too
        key, sep, value = item.partition("=")
        key = key.strip().removeprefix("attributes.")
        if not sep or not _KEY.fullmatch(key):
            raise ValueError(f"{item!r}: give key=value (letters, digits, _ and - in the key; a dotted key reaches into a mapping)")
        pairs.append((key, value.strip()))
    if len(pairs) > MAX_ATTRIBUTE_FILTERS:
        raise ValueError(f"at most {MAX_ATTRIBUTE_FILTERS} attribute filters")
    return tuple(pairs) or None
