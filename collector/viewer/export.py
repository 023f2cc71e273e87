"""Export selected trajectories as a dataset: JSONL or Parquet, streamed with constant memory.

One record per trajectory, shaped for ``datasets.load_dataset("json" | "parquet", ...)`` and for
SFT/RL tooling that reads OpenAI-style chat: ``messages`` (the prompt, each assistant turn with
its tool calls, each tool result), the reward (and what the trainer did when annotated: advantage,
trained, filtered_by, policy versions), the
index columns, and optionally the token ids.

Why the shape is what it is:

* every record has every column (null where unknown), and free-form values (root attributes,
  metrics, tool arguments) are JSON *strings*, so Arrow infers one schema for the whole file
  however the trajectories differ; tool-call ``arguments`` as a JSON string is also OpenAI's
  convention;
* Parquet has a fixed schema written up front, so ``sample_index`` (an opaque key, int or
  string) is a string there; JSONL keeps it as sent;
* the selection is walked in keyset pages of the viewer's trajectory index and each trajectory
  is read, shaped and written before the next, so memory is one page of summaries plus one
  Parquet row group, whatever the size of the store.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import orjson

from ..chat import chat_in, parse_template, strip_end
from ..loudness import RateLimited, describe_error
from ..read_store import ReadStore
from ..shape import RESPONSE_ID_KEYS, TOOL_METHODS, dict_or_empty, int_list, shape
from ..spool.query import get_trajectory
from ..spool.store import Spool
from .groups import advantage_of
from .index import ListFilter
from .truth import TRUTH_COLUMNS, truth_fields

FORMATS = ("jsonl", "parquet")
MEDIA_TYPES = {"jsonl": "application/x-ndjson", "parquet": "application/vnd.apache.parquet"}
PAGE_TRAJECTORIES = 200  # summaries read per index page
ARCHIVE_PAGE = 100  # trajectories whose archived spans (spool/archive.py) are read at once: one ClickHouse query each
ROW_GROUP_ROWS = 500  # Parquet rows per row group (bounded by bytes too)
ROW_GROUP_BYTES = 16 << 20
JSONL_CHUNK_BYTES = 256 << 10
SETTLE_TIMEOUT_S = 300.0  # how long an export waits for the trajectory index to catch up


log = logging.getLogger("tracecar.export")
_unreported_skips = RateLimited(10.0)  # rows left out where no caller counts them (on_skip unset): logged rate-limited
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: told of each trajectory an export leaves out, with why (its record or its line could not be written)
OnSkip = Callable[[str, str], None]


def _ids(value: Any) -> list[int] | None:
    """A token-id column's value: a list of plain ints that each fit the column's int64, else None."""
    ids = int_list(value)
    return ids if ids is not None and INT64_MIN <= min(ids) and max(ids) <= INT64_MAX else None


def _skip_reason(exc: BaseException) -> str:
    """Served to the caller and logged: a row's value it may quote is scrubbed of key=value secrets."""
    return describe_error(exc)


class IndexBehind(RuntimeError):
    """The trajectory index could not catch up with the store in time: an export would miss data."""


def settle(index: ReadStore, timeout_s: float = SETTLE_TIMEOUT_S) -> dict[str, Any]:
    """Indexes everything stored so far (an export must not silently miss what is not indexed yet)."""
    deadline = time.monotonic() + timeout_s
    while not index.refresh(budget_s=1.0):
        if time.monotonic() >= deadline:
            state = index.status()
            raise IndexBehind(f"trajectory index still {state['behind_spans']} spans behind the store after {timeout_s:.0f} s;"
                              " retry when it has caught up (GET /ui/api/status)")
    return index.status()


def selected(index: ReadStore, flt: ListFilter, *, limit: int | None = None,
             page: int = PAGE_TRAJECTORIES) -> Iterator[dict[str, Any]]:
    """Summaries of the selection, page by page (keyset: stable while new trajectories arrive)."""
    cursor, count = 0, 0
    while limit is None or count < limit:
        rows = index.page_after(flt, cursor, page if limit is None else min(page, limit - count))
        if not rows:
            return
        yield from rows
        count += len(rows)
        cursor = rows[-1]["cursor"]


def _json_text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY, default=repr).decode()


def _walk(root: dict[str, Any]) -> Iterator[dict[str, Any]]:
    stack = [root]
    while stack:
        span = stack.pop()
        yield span
        stack.extend(reversed(span.get("children") or ()))


def _tool_name(span: dict[str, Any]) -> str:
    """``CalculatorTool.execute`` -> ``CalculatorTool``; a tool named by its inputs wins."""
    inputs = dict_or_empty(span.get("inputs"))
    for key in ("tool_name", "name"):
        if isinstance(inputs.get(key), str):
            return inputs[key]
    owner, _, method = str(span.get("name", "")).rpartition(".")
    return owner if owner and method.lower() in TOOL_METHODS else str(span.get("name", "tool"))


def _initial_messages(root: dict[str, Any], first_prompt: str | None) -> list[dict[str, Any]]:
    """The chat the agent loop was given, when a span recorded it (VERL: ``inputs.kwargs.raw_prompt``,
    see :mod:`..chat`); else the decoded first prompt, its chat template undone where it is a known
    one, else as one user message."""
    for span in _walk(root):
        chat = chat_in(span.get("inputs"))
        if chat is not None:
            return [_message(str(m["role"]), _json_text(m.get("content"))) for m in chat]
    if first_prompt is None:
        return []
    parsed = parse_template(first_prompt)
    if parsed is None:
        return [_message("user", first_prompt)]
    return [_message(m["role"], m["content"]) for m in parsed]


def _message(role: str, content: str | None, *, tool_calls: list[dict[str, Any]] | None = None,
             tool_call_id: str | None = None, name: str | None = None) -> dict[str, Any]:
    return {"role": role, "content": content, "tool_calls": tool_calls or [], "tool_call_id": tool_call_id, "name": name}


def _token_arrays(root: dict[str, Any], spans: dict[Any, dict[str, Any]], turns: list[dict[str, Any]]) -> dict[str, Any]:
    """prompt_ids / response_ids / response_mask: the agent loop's own output when it has them
    (VERL's ``AgentLoopOutput``: tool outputs included, masked 0), else the turns' ids joined."""
    for span in _walk(root):
        output = span.get("output")
        if span.get("children") and isinstance(output, dict) and _ids(output.get("response_ids")) is not None:
            return {"prompt_ids": _ids(output.get("prompt_ids")), "response_ids": output["response_ids"],
                    "response_mask": _ids(output.get("response_mask"))}
    prompt, response = None, []
    for number, turn in enumerate(turns):
        span = spans.get(turn["span_id"]) or {}
        output = dict_or_empty(span.get("output"))
        inputs = dict_or_empty(span.get("inputs"))
        if number == 0:
            prompt = _ids(output.get("prompt_ids")) or _ids(inputs.get("prompt_ids"))
        response += next((ids for ids in (_ids(output.get(k)) for k in RESPONSE_ID_KEYS) if ids), [])
    return {"prompt_ids": prompt, "response_ids": response or None, "response_mask": None}


def record(tree: dict[str, Any], summary: dict[str, Any], *, token_ids: bool = False) -> dict[str, Any]:
    """One exported trajectory: index columns, reward, chat messages, attributes (JSON text)."""
    view = shape(tree)
    root = tree["root"]
    spans = {s.get("span_id"): s for s in _walk(root)}
    turns = view["turns"]
    first_prompt = turns[0].get("prompt_text") if turns else None
    messages = _initial_messages(root, first_prompt)
    for turn in turns:
        tools = [e for e in turn["after"] if e["type"] == "tool"]
        calls = [{"id": e["span_id"], "type": "function",
                  "function": {"name": _tool_name(spans.get(e["span_id"]) or {}), "arguments": _json_text(e.get("arguments")) or "{}"}}
                 for e in tools]
        assistant = _message("assistant", strip_end(turn.get("response_text")), tool_calls=calls)
        if token_ids:
            output = (spans.get(turn["span_id"]) or {}).get("output") or {}
            assistant["token_ids"] = next((_ids(output.get(k)) for k in RESPONSE_ID_KEYS if _ids(output.get(k))), None)
        messages.append(assistant)
        for event in tools:
            content = f"error: {event['error']}" if event.get("error") else _json_text(event.get("result"))
            messages.append(_message("tool", content, tool_call_id=event["span_id"],
                                     name=_tool_name(spans.get(event["span_id"]) or {})))
    if token_ids:
        for message in messages:
            message.setdefault("token_ids", None)
    metrics = {m["key"]: m["value"] for m in view["metrics"]}
    out = {
        "trace_id": tree["trace_id"], "name": view["name"], "experiment": summary.get("experiment"),
        "step": summary.get("step"), "sample_index": summary.get("sample_index"), "rollout_n": summary.get("rollout_n"),
        "validate": summary.get("validate"), "worker": summary.get("worker"), "node": summary.get("node"), "reward": view["reward"],
        "advantage": advantage_of(tree), "trained": summary.get("trained"), "filtered_by": summary.get("filtered_by"),
        "policy_version": summary.get("policy_version"), "trained_on_version": summary.get("trained_on_version"),
        "kept_because": _json_text(view["kept_because"]),
        "has_error": bool(view["has_error"]), "turns": view["turn_count"], "tool_calls": view["tool_calls"],
        "start_time": view["start_time"], "duration": view["duration"],
        "prompt": first_prompt, "final_response": turns[-1].get("response_text") if turns else None,
        "messages": messages, "attributes": _json_text(view["attributes"]) or "{}", "metrics": _json_text(metrics) or "{}",
    }
    out.update(truth_fields(summary))
    if token_ids:
        out.update(_token_arrays(root, spans, turns))
    return out


def records(spool: Spool, index: ReadStore, flt: ListFilter, *, token_ids: bool = False,
            limit: int | None = None, on_skip: OnSkip | None = None) -> Iterator[dict[str, Any]]:
    """The selection's records, one trajectory read at a time (one dropped meanwhile is skipped; those retention moved
    to the archive read ``ARCHIVE_PAGE`` at a time).

    A trajectory whose record cannot be built (a stored value no rule foresaw) is left out and
    named to ``on_skip``: it costs that row, never the stream."""
    summaries = selected(index, flt, limit=limit)
    for page in iter(lambda: list(itertools.islice(summaries, ARCHIVE_PAGE)), []):
        archived = spool.archived_of([s["trace_id"] for s in page])  # evicted ones: one archive read a page
        for summary in page:
            tree = get_trajectory(spool, summary["trace_id"], archived=archived)
            if tree is None:
                continue
            try:
                row = record(tree, summary, token_ids=token_ids)
            except Exception as exc:  # noqa: BLE001 - one trajectory's values must not tear the whole export
                _skipped(on_skip, summary["trace_id"], exc)
                continue
            yield row


def _skipped(on_skip: OnSkip | None, trace_id: Any, exc: BaseException) -> None:
    reason = _skip_reason(exc)
    if on_skip is not None:
        on_skip(str(trace_id), reason)
        return
    count = _unreported_skips.hit()
    if count is not None:
        log.warning("export: %d trajectory row(s) left out since the last line (latest: %s: %s); logged at most once "
                    "every %g s", count, trace_id, reason, _unreported_skips.interval_s)


# ---- writers -------------------------------------------------------------------------------------
def jsonl_chunks(rows: Iterator[dict[str, Any]], chunk_bytes: int = JSONL_CHUNK_BYTES,
                 on_skip: OnSkip | None = None) -> Iterator[bytes]:
    """One JSON object per line, yielded in chunks of about ``chunk_bytes`` (a row orjson cannot
    write is left out and named to ``on_skip``)."""
    buffer: list[bytes] = []
    size = 0
    for row in rows:
        try:
            line = orjson.dumps(row, option=orjson.OPT_NON_STR_KEYS) + b"\n"
        except (orjson.JSONEncodeError, TypeError) as exc:
            _skipped(on_skip, row.get("trace_id"), exc)
            continue
        buffer.append(line)
        size += len(line)
        if size >= chunk_bytes:
            yield b"".join(buffer)
            buffer, size = [], 0
    if buffer:
        yield b"".join(buffer)


def parquet_schema(token_ids: bool) -> Any:
    import pyarrow as pa

    kinds = {"int": pa.int64(), "str": pa.string(), "bool": pa.bool_(), "float": pa.float64()}
    truth_columns = [(name, kinds[kind]) for name, kind in TRUTH_COLUMNS]

    call = pa.struct([("id", pa.string()), ("type", pa.string()),
                      ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())]))])
    message_fields = [("role", pa.string()), ("content", pa.string()), ("tool_calls", pa.list_(call)),
                      ("tool_call_id", pa.string()), ("name", pa.string())]
    if token_ids:
        message_fields.append(("token_ids", pa.list_(pa.int64())))
    fields = [
        ("trace_id", pa.string()), ("name", pa.string()), ("experiment", pa.string()), ("step", pa.int64()),
        ("sample_index", pa.string()), ("rollout_n", pa.int64()), ("validate", pa.bool_()), ("worker", pa.string()),
        ("node", pa.string()), ("reward", pa.float64()), ("advantage", pa.float64()), ("trained", pa.bool_()), ("filtered_by", pa.string()),
        ("policy_version", pa.int64()), ("trained_on_version", pa.int64()), ("kept_because", pa.string()), ("has_error", pa.bool_()),
        ("turns", pa.int64()), ("tool_calls", pa.int64()), ("start_time", pa.float64()), ("duration", pa.float64()),
        ("prompt", pa.string()), ("final_response", pa.string()), ("messages", pa.list_(pa.struct(message_fields))),
        ("attributes", pa.string()), ("metrics", pa.string()), *truth_columns,
    ]
    if token_ids:
        fields += [("prompt_ids", pa.list_(pa.int64())), ("response_ids", pa.list_(pa.int64())),
                   ("response_mask", pa.list_(pa.int64()))]
    return pa.schema(fields)


class _Drain:
    """A write-only file that hands over what was written since the last ``take``."""

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._position = 0
        self.closed = False

    def write(self, data: Any) -> int:
        chunk = bytes(data)
        self._chunks.append(chunk)
        self._position += len(chunk)
        return len(chunk)

    def tell(self) -> int:
        return self._position

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def take(self) -> bytes:
        out = b"".join(self._chunks)
        self._chunks.clear()
        return out


def parquet_chunks(rows: Iterator[dict[str, Any]], *, token_ids: bool = False, row_group_rows: int = ROW_GROUP_ROWS,
                   row_group_bytes: int = ROW_GROUP_BYTES, on_skip: OnSkip | None = None) -> Iterator[bytes]:
    """A Parquet file, yielded a row group at a time (footer last).

    The schema is fixed up front; a row whose values do not fit it is found when its row group
    is converted (the group is then converted row by row), left out and named to ``on_skip``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = parquet_schema(token_ids)
    drain = _Drain()
    writer = pq.ParquetWriter(pa.PythonFile(drain, mode="w"), schema, compression="zstd")
    batch: list[dict[str, Any]] = []
    size = 0

    def table() -> Any:
        try:
            return pa.Table.from_pylist(batch, schema=schema)
        except Exception:  # noqa: BLE001 - one row does not fit: find it, keep the others
            kept = []
            for row in batch:
                try:
                    kept.append(pa.Table.from_pylist([row], schema=schema))
                except Exception as exc:  # noqa: BLE001
                    _skipped(on_skip, row.get("trace_id"), exc)
            return pa.concat_tables(kept) if kept else schema.empty_table()

    def flush() -> bytes:
        nonlocal batch, size
        writer.write_table(table())
        batch, size = [], 0
        return drain.take()

    try:
        for row in rows:
            if row["sample_index"] is not None:
                row["sample_index"] = str(row["sample_index"])
            batch.append(row)
            size += sum(len(m["content"]) for m in row["messages"] if isinstance(m.get("content"), str))
            size += len(row["attributes"]) if isinstance(row["attributes"], str) else 0
            if len(batch) >= row_group_rows or size >= row_group_bytes:
                yield flush()
        if batch:
            yield flush()
    finally:
        writer.close()
    yield drain.take()


def export_chunks(spool: Spool, index: ReadStore, flt: ListFilter, fmt: str, *, token_ids: bool = False,
                  limit: int | None = None, on_skip: OnSkip | None = None) -> Iterator[bytes]:
    """The whole export as byte chunks (what the HTTP response streams and the CLI writes); a
    trajectory that cannot be written costs its row only, named to ``on_skip``."""
    rows = records(spool, index, flt, token_ids=token_ids, limit=limit, on_skip=on_skip)
    if fmt == "parquet":
        yield from parquet_chunks(rows, token_ids=token_ids, on_skip=on_skip)
    else:
        yield from jsonl_chunks(rows, on_skip=on_skip)


def parquet_available() -> bool:
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        return False
    return True
