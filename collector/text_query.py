"""A user's words as a full-text query over the previews table (viewer/search.py keeps the table).

Shared, so the one trajectory filter (trajectory_filter.py), which every list builds its WHERE
clause with, can add a ``q=`` search without importing the viewer.
"""

from __future__ import annotations

import re
import unicodedata

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


_TOKEN = re.compile(r"[^\W_]+", re.UNICODE)  # FTS5 unicode61: letters and digits; "_" separates


def folded_words(text: str | None) -> list[str]:
    """A text's words as FTS5's unicode61 tokenizer (remove_diacritics 2) sees them: lower case, no accents.

    For a store without FTS5 (ClickHouse keeps ``" w1 w2 … "`` and matches words in it), so that a
    search finds the same trajectories there.
    """
    if not text:
        return []
    plain = "".join(c for c in unicodedata.normalize("NFKD", text.lower()) if not unicodedata.combining(c))
    return _TOKEN.findall(plain)


def query_words(text: str) -> list[str]:
    """The user's words as :func:`fts_query` reads them (every word must occur, the last may be a prefix), folded."""
    return [w for word in _WORD.findall(text[:QUERY_MAX_CHARS]) for w in folded_words(word)]
