"""Prompt references: rebuild the full ``prompt_ids`` a wire-version-2 client sent as a delta.

A v2 span may carry ``inputs.prompt_ids = {"$ref": <span_id>, "n": N, "add": [ids]}``
(:mod:`tracecar.client.prompt_delta`): the first N ids of the referenced span's context (its
``inputs.prompt_ids`` followed by its output's ``response_ids``, else ``token_ids``), then
``add``. The list is rebuilt here, before sampling, so the store, the decoder, Weave and every
exporter see exactly the list VERL passed.

The contexts of the spans of v2 batches are kept per worker in a bounded LRU
(``TRACECAR_PROMPT_REFS_MAX_BYTES``; evictions counted). A reference that cannot be resolved —
the earlier span was evicted, never arrived, or the collector restarted — rejects that span by
name with a reason starting "unresolved prompt ref"; the client sends it again in full, so
nothing is lost. Each context also keeps the prompt's decoded text, so the next turn decodes
only its new ids (:func:`tracecar.collector.processors.decoding.decode_spans`).
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tracecar.client.prompt_delta import OUTPUT_REF_KEYS, REF_KEY, UNRESOLVED_REASON, as_ids, response_of

from ..types import RawIds
from .validate import Rejection, Validated

_ENTRY_OVERHEAD = 200  # bytes of the entry's own objects, on top of ids and text
_BYTES_PER_ID = 36  # a list slot and an int object (ids parsed from JSON are objects of their own)
#: what one rebuilt id costs a batch on its way to the store: its slot in the rebuilt list (the int
#: objects are the context's) and its text in the stored row (tracecar.collector.receivers.pipeline
#: bounds a batch's rebuilt ids to TRACECAR_MAX_DECOMPRESSED_BYTES / REBUILT_ID_BYTES: one body's worth)
REBUILT_ID_BYTES = 16


def max_rebuilt_ids(max_decompressed_bytes: int) -> int:
    """The ids the references of one batch may rebuild: as much memory as one decompressed body."""
    return max_decompressed_bytes // REBUILT_ID_BYTES


@dataclass
class Context:
    """One span's context: prompt + response ids, how many are the prompt, their decoded texts.

    The ids are the span's own lists, referenced, never copied: ``ids`` (the prompt, or the whole
    context) followed by ``response`` when given. Concatenating them cost a copy and a free of
    every id per span on the ingest path, for contexts most of which no later span reads.
    ``response_source`` names the output field the response came from (``output.token_ids``):
    its ``response_text`` is reused only if decoded from that same list. Either list may be
    :class:`RawIds` (ids kept as received): parsed the first time a later turn slices it.
    """

    ids: list[Any] | RawIds
    prompt_len: int
    response_source: str | None = None
    text: str | None = None
    response_text: str | None = None
    tokenizer: str | None = None
    response: list[Any] | RawIds | None = None  # the ids after ``ids`` (the span's response list)
    # (L, span_id): the first L ids are exactly that earlier span's prompt (a turn built on it from
    # its start), whose text is then known: an output repeating them reuses it, never decodes them again
    marks: tuple[tuple[int, str], ...] = ()
    # bytes counted against the bound when remembered: what is subtracted when it goes (size is
    # not stable: a text's size grows once its UTF-8 form is cached, e.g. by serialising it)
    counted: int = field(default=0, repr=False, compare=False)

    @property
    def n_ids(self) -> int:
        return len(self.ids) + len(self.response) if self.response is not None else len(self.ids)

    def slice(self, start: int, stop: int) -> list[Any]:
        """The context's ids ``[start:stop]`` as a new list (``0 <= start <= stop <= n_ids``)."""
        head = self.ids
        if isinstance(head, RawIds):  # kept as received: parsed once, for this and any later turn
            head = self.ids = head.tolist()
        response = self.response
        if response is None or stop <= len(head):
            return head[start:stop]
        if isinstance(response, RawIds):
            response = self.response = response.tolist()
        if start >= len(head):
            return response[start - len(head):stop - len(head)]
        return head[start:] + response[:stop - len(head)]

    @property
    def size(self) -> int:
        text, response_text = self.text, self.response_text
        texts = (sys.getsizeof(text) if text is not None else 0) + (sys.getsizeof(response_text) if response_text is not None else 0)
        return self.n_ids * _BYTES_PER_ID + texts + _ENTRY_OVERHEAD + 64 * len(self.marks)

    @classmethod
    def of(cls, prompt: list[Any] | RawIds, output: Any) -> Context:
        """prompt + response, as :func:`tracecar.client.prompt_delta.context_of` builds it on the client."""
        key, value = response_of(output)
        response = ids_of(value)
        if not response:
            return cls(prompt, len(prompt))
        return cls(prompt, len(prompt), f"output.{key}", response=response)


def ids_of(value: Any) -> list[Any] | RawIds | None:
    """:func:`tracecar.client.prompt_delta.as_ids`, taking ids kept as received too (never empty)."""
    return value if type(value) is RawIds else as_ids(value)


@dataclass
class Base:
    """A rebuilt prompt starts with the referenced span's prompt: its text can be reused."""

    worker: str
    ref: str
    prompt_len: int
    with_response: bool  # the rebuilt prompt continues with the whole of the ref's response
    start: int = 0  # an output's response_ids: where they start in the context (its prompt_ids are the rest)


class PromptContexts:
    """Bounded, thread-safe memory of contexts, keyed by (worker, span_id)."""

    def __init__(self, max_bytes: int, on_evict: Callable[[int], None] | None = None) -> None:
        self.max_bytes = max_bytes
        self.on_evict = on_evict
        self._entries: OrderedDict[tuple[str, str], Context] = OrderedDict()
        self._trace_of: dict[tuple[str, str], str] = {}  # entry -> its trajectory (released when that ends)
        self._of_trace: dict[tuple[str, str], set[str]] = {}  # (worker, trace) -> its entries' span ids
        self._ended: list[tuple[str, str]] = []  # trajectories whose root arrived, released by the next batch
        self._bytes = 0
        self._lock = threading.Lock()

    def _drop(self, key: tuple[str, str]) -> Context | None:
        """Removes one entry and its trajectory link (the lock held)."""
        gone = self._entries.pop(key, None)
        if gone is not None:
            self._bytes -= gone.counted
        trace = self._trace_of.pop(key, None)
        if trace is not None:
            members = self._of_trace.get((key[0], trace))
            if members is not None:
                members.discard(key[1])
                if not members:
                    del self._of_trace[(key[0], trace)]
        return gone

    def trajectory_ended(self, worker: str, trace_id: str) -> None:
        """A trajectory's root arrived: no later turn refers to its contexts (the client forgets a
        trajectory's requests when it sends the root). They are released by :meth:`release_ended`
        once the batch that carried the root is decoded (the pipeline calls it then; the next
        batch's :func:`resolve_refs` too), so that batch still finds its bases' texts; without
        this every finished trajectory's ids sat in memory until the LRU bound pushed them out
        (128 MiB by default, held for good by a collector that has seen enough spans). Released
        in the batch that ended them, their lists die young, as the batch's own do, instead of
        being carried (and walked by the garbage collector) into the next batch."""
        with self._lock:
            if (worker, trace_id) in self._of_trace:
                self._ended.append((worker, trace_id))

    def release_ended(self) -> int:
        """Frees the contexts of the trajectories ended before this batch; returns how many."""
        with self._lock:
            ended, self._ended = self._ended, []
            released = 0
            for worker, trace in ended:
                for span_id in list(self._of_trace.get((worker, trace), ())):
                    released += self._drop((worker, span_id)) is not None
            return released

    @property
    def ended(self) -> bool:
        """Whether ended trajectories wait for :meth:`release_ended`."""
        return bool(self._ended)

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def trace_of(self, worker: str, span_id: str) -> str | None:
        """The trajectory of a remembered context (None: not known)."""
        with self._lock:
            return self._trace_of.get((worker, span_id))

    def get(self, worker: str, span_id: str) -> Context | None:
        with self._lock:
            entry = self._entries.get((worker, span_id))
            if entry is not None:
                self._entries.move_to_end((worker, span_id))
            return entry

    def remember(self, worker: str, span_id: str, context: Context, trace_id: str | None = None) -> None:
        key = (worker, span_id)
        evicted = 0
        with self._lock:
            trace = self._trace_of.get(key) if trace_id is None else trace_id
            self._drop(key)
            context.counted = context.size
            if context.counted > self.max_bytes:
                return
            self._entries[key] = context
            self._bytes += context.counted
            if trace is not None:
                self._trace_of[key] = trace
                self._of_trace.setdefault((worker, trace), set()).add(span_id)
            while self._bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))
                evicted += 1
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)

    def remember_new(self, worker: str, fresh: list[tuple[str, Context, str | None]]) -> list[str]:
        """:meth:`remember` of each (span_id, context, trace_id) not remembered yet, under one lock
        (a batch's spans at once); a known one is only touched, as :meth:`get` does. Returns the
        span ids remembered."""
        done: list[str] = []
        evicted = 0
        with self._lock:
            entries = self._entries
            for span_id, context, trace_id in fresh:
                key = (worker, span_id)
                if key in entries:
                    entries.move_to_end(key)
                    continue
                context.counted = context.size
                if context.counted > self.max_bytes:
                    continue
                trace = self._trace_of.get(key) if trace_id is None else trace_id
                self._drop(key)  # a trajectory link left by an entry evicted before
                entries[key] = context
                self._bytes += context.counted
                if trace is not None:
                    self._trace_of[key] = trace
                    self._of_trace.setdefault((worker, trace), set()).add(span_id)
                done.append(span_id)
                while self._bytes > self.max_bytes:
                    self._drop(next(iter(entries)))
                    evicted += 1
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        return done

    def set_texts(self, worker: str, span_id: str, text: str | None, response_text: str | None, tokenizer: str) -> None:
        """The prompt's and the response's decoded texts, for the next turn (counted against the bound)."""
        with self._lock:
            entry = self._entries.get((worker, span_id))
            if entry is None:
                return
            self._bytes -= entry.counted
            entry.text, entry.response_text, entry.tokenizer = text, response_text, tokenizer
            entry.counted = entry.size
            self._bytes += entry.counted
        self.remember(worker, span_id, entry)  # re-applies the bound


def _parse_ref(value: dict[str, Any]) -> tuple[str, int, int, list[Any]] | str:
    """(ref, from, n, add), or why the reference is malformed."""
    ref, start, n, add = value.get(REF_KEY), value.get("from", 0), value.get("n"), value.get("add")
    if not isinstance(ref, str) or not ref:
        return f"{REF_KEY} must be the span_id of an earlier span"
    if type(n) is not int or n < 0:
        return "n must be a non-negative integer"
    if type(start) is not int or not 0 <= start <= n:
        return "from must be an integer from 0 to n"
    if type(add) is not list:
        return "add must be a list of token ids"
    return ref, start, n, add


def _is_ref(value: Any) -> bool:
    return type(value) is dict and REF_KEY in value


is_ref = _is_ref  # for the pipeline: which lists a worker process must be sent rebuilt


def _rebuild(value: dict[str, Any], worker: str, contexts: PromptContexts,
             trace_id: str | None = None) -> tuple[list[Any], str, Context, int] | str:
    """(the full list, ref, its context, n), or why it cannot be rebuilt (the rejection's reason).

    A reference resolves within its sender's worker and its own trajectory only (the client
    refers to earlier turns of the same trajectory): naming another worker's or another
    trajectory's span rebuilds nothing (docs/guarantees.md, *Access*: a scope, not a secret)."""
    parsed = _parse_ref(value)
    if isinstance(parsed, str):
        return f"malformed prompt reference: {parsed}"
    ref, start, n, add = parsed
    entry = contexts.get(worker, ref)
    if entry is None:
        return (f"{UNRESOLVED_REASON}: span {ref!r} is not known to this collector (restarted, or evicted under "
                "TRACECAR_PROMPT_REFS_MAX_BYTES); send the full list")
    known_trace = contexts.trace_of(worker, ref)
    if trace_id is not None and known_trace is not None and known_trace != trace_id:
        return (f"{UNRESOLVED_REASON}: span {ref!r} belongs to another trajectory; a reference resolves within its own "
                "trajectory; send the full list")
    if n > entry.n_ids:
        return f"{UNRESOLVED_REASON}: n={n} exceeds the {entry.n_ids} ids of span {ref!r}"
    rebuilt = entry.slice(start, n)
    rebuilt += add
    return rebuilt, ref, entry, n


def _whole_context(slices: dict[str, Any]) -> tuple[str, Context, int] | None:
    """(ref, context, start) when an output's prompt_ids + response_ids are exactly one whole
    context with a response (its response text can then be cut from the context's text)."""
    if set(slices) != {"prompt_ids", "response_ids"}:
        return None
    (prompt, (_, ref, entry, n_prompt)), (response, (_, ref2, _, n_response)) = slices["prompt_ids"], slices["response_ids"]
    if ref != ref2 or entry.response_source is None or len(prompt) != n_prompt or n_response != entry.n_ids \
            or len(prompt) + len(response) != entry.n_ids:
        return None
    return ref, entry, n_prompt


def resolve_refs(validated: Validated, contexts: PromptContexts, max_ids: int,
                 stored: set[str] | frozenset[str] = frozenset()) -> tuple[dict[Any, Base], int]:
    """Rebuilds every referenced ``inputs.prompt_ids`` in place and remembers each span's context.

    Also rebuilds output ``prompt_ids`` / ``response_ids`` sent as slices of a context
    (``"from"``: VERL's AgentLoopOutput repeats the trajectory's context). Spans are taken in
    batch order, so a reference to an earlier span of the same batch resolves. Returns the spans
    whose prompt starts with their reference's whole prompt (their text can be reused) and how
    many spans had their references resolved; an unresolvable or malformed reference rejects its span by
    name (``spans[i].inputs.prompt_ids``, ``spans[i].output.response_ids``). ``max_ids`` bounds
    the ids one batch may rebuild (a small body must not grow without bound in memory); the spans
    past it are refused as unresolved, so the client resends them whole, where the body bounds apply.
    ``stored``: spans of the batch the store holds already (resends, dropped as duplicates when
    written): their context is not remembered, so a later reference rebuilds what the store holds.
    """
    worker = validated.batch.worker
    contexts.release_ended()
    bases: dict[Any, Base] = {}
    resolved = rebuilt_ids = 0
    kept = []
    # contexts to remember, taken under one lock (remember_new) before a span that refers to
    # another (it may name one of them: references resolve in batch order) and after the batch
    pending: list[tuple[str, Context, str | None]] = []

    def flush() -> None:
        if pending:
            validated.remembered.update(contexts.remember_new(worker, pending))
            pending.clear()

    for span in validated.spans:
        inputs = span.get("inputs")
        prompt = inputs.get("prompt_ids") if type(inputs) is dict else None
        output = span.get("output")
        # _is_ref inlined: this runs once per span, and most spans carry no reference
        targets = [("inputs", inputs, "prompt_ids")] if type(prompt) is dict and REF_KEY in prompt else []
        if type(output) is dict:
            for key in OUTPUT_REF_KEYS:
                value = output.get(key)
                if type(value) is dict and REF_KEY in value:
                    targets.append(("output", output, key))
        if targets:
            flush()
        failed, slices = None, {}
        stored_as: list[tuple[str, str, str, int, int]] = []
        marks: tuple[tuple[int, str], ...] = ()
        for part, holder, key in targets:
            rebuilt = _rebuild(holder[key], worker, contexts, span.get("trace_id"))
            if type(rebuilt) is not str:
                rebuilt_ids += len(rebuilt[0])
                if rebuilt_ids > max_ids:
                    rebuilt = (f"{UNRESOLVED_REASON}: the references of this batch rebuild more than {max_ids} ids "
                               f"(TRACECAR_MAX_DECOMPRESSED_BYTES / {REBUILT_ID_BYTES}); send the full list")
            if isinstance(rebuilt, str):
                failed = (f"{part}.{key}", rebuilt)
                break
            value = holder[key]
            holder[key] = rebuilt[0]
            stored_as.append((part, key, rebuilt[1], value.get("from", 0), rebuilt[3]))
            if part == "output":
                slices[key] = (holder[key], rebuilt)
            if part == "inputs":
                _, ref, entry, n = rebuilt
                prompt = rebuilt[0]
                if stored_as[-1][3] == 0:  # the prompt starts with the ref's context: its known prefixes too
                    marks = tuple(m for m in entry.marks if m[0] <= n) + (((entry.prompt_len, ref),) if n >= entry.prompt_len else ())
                if n >= entry.prompt_len:
                    bases[span["span_id"]] = Base(worker, ref, entry.prompt_len,
                                                  with_response=n == entry.n_ids and entry.response_source is not None)
        if failed is not None:
            index = validated.index_of.get(span["span_id"], -1)
            validated.rejected.append(Rejection(index, span["span_id"], f"spans[{index}].{failed[0]}", failed[1]))
            validated.warnings.pop(span["span_id"], None)
            bases.pop(span["span_id"], None)
            continue
        kept.append(span)
        if stored_as:
            validated.store_refs[span["span_id"]] = stored_as
        resolved += bool(targets)
        whole = _whole_context(slices) if slices else None
        if whole is not None:
            bases[(span["span_id"], "output")] = Base(worker, whole[0], whole[1].prompt_len, True, whole[2])
        ids = ids_of(prompt)
        # a resend of a known span keeps the first context: the store keeps the first copy (the
        # resend is dropped as a duplicate), and later references must rebuild what it holds
        if ids is not None and span["span_id"] not in stored:  # (remember_new skips a span already known)
            context = Context.of(ids, output)
            context.marks = marks
            pending.append((span["span_id"], context, span.get("trace_id")))
    flush()
    for span in kept:
        if span.get("kind") == "trajectory":
            contexts.trajectory_ended(worker, span["trace_id"])
    validated.spans = kept
    return bases, resolved
