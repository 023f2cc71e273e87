"""A user's words as a full-text query over the previews table (viewer/search.py keeps the table).

Shared, so the one trajectory filter (trajectory_filter.py), which every list builds its WHERE
clause with, can add a ``q=`` search without importing the viewer.
"""

from __future__ import annotations

import re

QUERY_MAX_CHARS = 256

# The trajectories a search matches, as a clause of ListFilter.where() over ``trajectories``
# (one FTS query, then rowid seeks; the index never VACUUMs, so rowids stay put).
MATCH_CLAUSE = "rowid IN (SELECT rowid FROM previews_fts WHERE previews_fts MATCH ?)"

_WORD = re.compile(r"\w+", re.UNICODE)


def fts_query(text: str) -> str | None:
    """The user's words as an FTS5 query: every word must occur (the last may be a prefix).

    Words are quoted, so FTS5's operators and column filters in user input are plain text and
    a query can never be a syntax error. None when the text has no word at all.
    """
    words = _WORD.findall(text[:QUERY_MAX_CHARS])
    if not words:
        return None
    quoted = ['"' + w.replace('"', '""') + '"' for w in words]
    quoted[-1] += "*"
    return " AND ".join(quoted)
