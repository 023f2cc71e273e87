"""Prompt deltas: a growing ``prompt_ids`` is sent as "the earlier span's context + the new ids".

VERL re-sends the whole context on every turn (``prompt_ids`` of turn k holds turns 1..k), so
an 8-turn trajectory would carry each early token up to 8 times. For each request (the
trajectory, the span's name and its ``request_id`` input) the sender remembers the last span's
*context* — its ``inputs.prompt_ids`` followed by its output's ``response_ids`` (else
``token_ids``) — and, when the next call's prompt starts with it, writes
``inputs.prompt_ids`` as ``{"$ref": <earlier span_id>, "n": N, "add": [new ids]}``: the first N
ids of that context, then ``add``. The collector rebuilds the full list (wire version 2).

Runs on the sender thread only. The context is kept as a list sharing the caller's int
objects, so comparing the next prompt with it is a pointer copy and an identity check per id
(a few µs for thousands of ids; an int64 array would cost ~40 ns an id to build). Memory is
bounded by ``max_requests`` remembered requests and ``max_ids`` remembered ids in all (8 bytes an
id while the agent loop still holds its list, up to 36 once it let go); the least recently used
goes first and is counted (``prompt_refs.evicted``). A trajectory's memory is freed when its
root span is sent; a span outside any trajectory is not remembered (no later turn can match it).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

REF_KEY = "$ref"
#: The reason the collector gives for a reference it cannot resolve; the sender then resends in full.
UNRESOLVED_REASON = "unresolved prompt ref"
CONTEXT_RESPONSE_KEYS = ("response_ids", "token_ids")  # the collector decodes the first present as response_text
MIN_REF_IDS = 32  # a shorter shared prefix is not worth a reference
#: output fields that repeat a trajectory's context (VERL's AgentLoopOutput): sent as slices of it
OUTPUT_REF_KEYS = ("prompt_ids", "response_ids")


def as_ids(value: Any) -> list[Any] | None:
    """``value`` if it looks like a list of token ids (a list whose ends are ints), else None.

    Only the ends are checked (cheap); the collector names any other element when decoding.
    """
    if type(value) is not list or (value and (type(value[0]) is not int or type(value[-1]) is not int)):
        return None
    return value


def response_of(output: Any) -> tuple[str | None, Any]:
    """(key, value) of the response ids a context continues with: ``response_ids``, else
    ``token_ids`` (VERL's AgentLoopOutput, TokenOutput)."""
    if type(output) is not dict:
        return None, None
    for key in CONTEXT_RESPONSE_KEYS:
        value = output.get(key)
        if value is not None:
            return key, value
    return None, None


def context_of(prompt: list[Any], output: Any) -> list[Any]:
    """prompt + response: what a later ``{"$ref"}`` counts its N ids in (the collector builds the same).

    Always a new list, also without a response: ``prompt`` may be the caller's own list, which an
    agent loop grows (or refills) in place, and a context that changed after its span was sent
    would make a later reference claim ids that span never carried."""
    response = as_ids(response_of(output)[1])
    return prompt + response if response else prompt[:]


class PromptDeltas:
    """Per-request memory of the last context sent (sender thread only)."""

    def __init__(self, max_requests: int, max_ids: int) -> None:
        self.max_requests = max(0, max_requests)
        self.max_ids = max(0, max_ids)
        # None until the first answer: remember, send in full; True once the collector says it
        # reads wire version 2; False for an older collector (nothing remembered)
        self.enabled: bool | None = None
        self._last: OrderedDict[tuple[Any, ...], tuple[str, list[Any]]] = OrderedDict()
        self._by_trace: dict[str, set[tuple[Any, ...]]] = {}
        self._latest: dict[Any, tuple[Any, ...]] = {}  # trace -> the key remembered last
        self._ids = 0
        self.counts = {"sent": 0, "ids_saved": 0, "evicted": 0, "resent_full": 0}

    @property
    def remembered_ids(self) -> int:
        return self._ids

    def apply(self, wire: dict[str, Any], full: bool = False) -> bool:
        """Rewrites ``wire["inputs"]["prompt_ids"]`` (and an output repeating the context) as
        references where it can; True if it did.

        ``full``: send the whole lists (a resend after the collector could not resolve a
        reference) but remember the context still. The caller's dicts are never changed: the
        wire gets new ones.
        """
        if self.enabled is False or self.max_requests == 0:
            return False
        if wire.get("parent_id") is None:  # a root: its trajectory is over, or it is a call of its own
            if wire.get("kind") == "trajectory":
                self._forget_trace(wire.get("trace_id"))
            return False
        output = wire.get("output")
        sent_as_ref = False if full else self._output_refs(wire)
        inputs = wire.get("inputs")
        prompt_list = inputs.get("prompt_ids") if isinstance(inputs, dict) else None
        prompt = as_ids(prompt_list)
        if prompt is None or not isinstance(inputs, dict) or prompt_list is None:
            self.counts["sent"] += sent_as_ref
            return sent_as_ref
        request = inputs.get("request_id")
        key = (wire.get("trace_id"), wire.get("name"), request if type(request) in (str, int) else None)
        previous = self._last.get(key)
        if previous is not None and not full and self.enabled:
            ref, context = previous
            n = _shared_prefix(prompt, context)
            if n >= MIN_REF_IDS:
                wire["inputs"] = {**inputs, "prompt_ids": {REF_KEY: ref, "n": n, "add": prompt_list[n:]}}
                self.counts["ids_saved"] += n
                sent_as_ref = True
        self._remember(key, wire["span_id"], context_of(prompt, output))
        self.counts["sent"] += sent_as_ref
        return sent_as_ref

    def _output_refs(self, wire: dict[str, Any]) -> bool:
        """An output that repeats the trajectory's last context (``prompt_ids`` = its start,
        ``response_ids`` = the rest, as VERL's agent loop returns them) goes out as slices of it:
        ``{"$ref", "from": i, "n": j, "add": [...]}`` = context[i:j] + add."""
        output = wire.get("output")
        if not self.enabled or type(output) is not dict:
            return False
        key = self._latest.get(wire.get("trace_id"))
        previous = self._last.get(key) if key is not None else None
        if previous is None:
            return False
        ref, context = previous
        start, refs = 0, {}
        for name in OUTPUT_REF_KEYS:
            value = output.get(name)
            ids = as_ids(value)
            if ids is None:
                break
            end = min(len(context), start + len(ids))
            if end - start < MIN_REF_IDS or ids[:end - start] != context[start:end] or not _same_kinds(ids, context, start, end):
                break
            refs[name] = {REF_KEY: ref, "from": start, "n": end, "add": value[end - start:]}  # type: ignore[index]  # as_ids: a list
            self.counts["ids_saved"] += end - start
            start = end
            if end == len(context):
                break
        if not refs:
            return False
        wire["output"] = {**output, **refs}
        return True

    def set_enabled(self, enabled: bool) -> None:
        """What the collector's answer said about wire version 2; an older one frees the memory."""
        self.enabled = enabled
        if not enabled:
            self._last.clear()
            self._by_trace.clear()
            self._latest.clear()
            self._ids = 0

    def _remember(self, key: tuple[Any, ...], span_id: str, context: list[Any]) -> None:
        old = self._last.pop(key, None)
        if old is not None:
            self._ids -= len(old[1])
        if len(context) > self.max_ids:  # too large to keep: the request's next turn goes out whole
            self._drop_from_trace(key)
            return
        self._last[key] = (span_id, context)
        self._by_trace.setdefault(key[0], set()).add(key)
        self._latest[key[0]] = key
        self._ids += len(context)
        while self._ids > self.max_ids or len(self._last) > self.max_requests:
            gone, (_, ids) = self._last.popitem(last=False)
            self._ids -= len(ids)
            self._drop_from_trace(gone)
            self.counts["evicted"] += 1

    def _drop_from_trace(self, key: tuple[Any, ...]) -> None:
        keys = self._by_trace.get(key[0])
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_trace[key[0]]
                self._latest.pop(key[0], None)

    def _forget_trace(self, trace_id: Any) -> None:
        """The trajectory's root is sent: its turns are over, so their memory goes."""
        self._latest.pop(trace_id, None)
        for key in self._by_trace.pop(trace_id, ()):
            entry = self._last.pop(key, None)
            if entry is not None:
                self._ids -= len(entry[1])


def _shared_prefix(prompt: list[Any], context: list[Any]) -> int:
    """How many ids of ``context`` the prompt starts with: all of it, or its prompt part, else 0.

    Only the whole context is tried (one C comparison): agent loops append to it.
    """
    n = len(context)
    # the ends first: another request's prompt (or a trimmed one) differs there, and costs no slice
    if n and len(prompt) >= n and prompt[n - 1] == context[-1] and prompt[0] == context[0] \
            and prompt[:n] == context and _same_kinds(prompt, context, 0, n):
        return n
    return 0


def _same_kinds(ids: list[Any], context: list[Any], start: int, end: int) -> bool:
    """``==`` holds 1 == 1.0 == True: the ends must be ints on both sides too (token ids are)."""
    return end <= start or (type(ids[0]) is int and type(ids[end - start - 1]) is int
                            and type(context[start]) is int and type(context[end - 1]) is int)
