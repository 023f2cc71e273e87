"""client/redact.py: secrets a free text (an exception message, a repr, a traceback frame) carries,
and secrets nested past the client's depth bound, never leave in clear."""

from __future__ import annotations

import random

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracecar.client import redact as redact_module
from tracecar.client.redact import REDACTED, RedactKeys, scrub_exception
from tracecar.client.wire import WireEncoder, pack_span

KEYS = RedactKeys()


@pytest.mark.parametrize(("text", "scrubbed"), [
    # an authorization scheme with its credential (the scheme alone was replaced before)
    ("headers Authorization: Bearer sk-A1 ; retry", "headers Authorization: REDACTED ; retry"),
    ("authorization=Basic dXNlcjpwYXNz==", "authorization=REDACTED"),
    ("Authorization: Bearer", "Authorization: REDACTED"),
    # JSON held in a string: escaped quotes around the key and the value
    ('{\\"api_key\\": \\"sk-A2\\", \\"x\\": 1}', '{\\"api_key\\": REDACTED, \\"x\\": 1}'),
    # a repr whose value is a list, a dict or a tuple, up to the matching bracket
    ("Cfg(api_key=['pk', 'sk-A3'], other=1)", "Cfg(api_key=REDACTED, other=1)"),
    ("Cfg(api_key={'primary': ('sk-A4', 'x]')}, b=2)", "Cfg(api_key=REDACTED, b=2)"),
    ("cut repr api_key=(1, 'sk-A5'", "cut repr api_key=REDACTED"),
    # the shapes that held before
    ("{'Authorization': 'Bearer sk-A6'}", "{'Authorization': REDACTED}"),
    ("API_KEY = sk-A7, next", "API_KEY = REDACTED, next"),
    ("api_key='it\\'s sk-A8' then", "api_key=REDACTED then"),
    # an inner string's escaped quote is part of the value, and the value ends at its closing quote
    ('{\\"api_key\\": \\"sk\\\\\\"A9\\", \\"x\\": 1}', '{\\"api_key\\": REDACTED, \\"x\\": 1}'),
    # a value cut short stops at the end of its line: the traceback after it stays readable
    ('api_key="sk-A10\nTraceback (most recent call last):', 'api_key=REDACTED\nTraceback (most recent call last):'),
    ("Cfg(api_key=['sk-A11'\n  File \"x.py\"", 'Cfg(api_key=REDACTED\n  File "x.py"'),
    # not a secret: no separator after the key, or the key inside a longer name
    ("authorization failed for user 7", "authorization failed for user 7"),
    ("my_api_key=not-ours", "my_api_key=not-ours"),
    ("api_key=", "api_key="),
    # a bearer credential whatever precedes it; the word alone, or before a short word, is no secret
    ("authorization -> Bearer sk-A12.def0123456789==", "authorization -> Bearer REDACTED"),
    ("retrying with bearer eyJhbGciOiJIUzI1NiJ9.e30.sig", "retrying with bearer REDACTED"),
    ("a bearer of news; Bearer bonds; the ring bearer walked-through-the-door", "a bearer of news; Bearer bonds; the ring bearer walked-through-the-door"),
    ("bearer 2024-01-01T00:00:00 expired; bearer 12345678 90", "bearer 2024-01-01T00:00:00 expired; bearer 12345678 90"),
])
def test_free_text_secrets_are_replaced_whatever_their_shape(text: str, scrubbed: str) -> None:
    assert KEYS.scrub_text(text) == scrubbed


def test_a_traceback_frames_file_and_function_names_are_scrubbed_too() -> None:
    span = {"exception": "E: api_key=sk-B1", "exception_info": {"message": "token Authorization: Bearer sk-B2", "traceback": [
        {"filename": "/srv/app.py?api_key=sk-B3", "function_name": "call[api_key=sk-B4]", "line_number": 3,
         "text": "post(api_key='sk-B5')"}]}}
    span["exception_info"]["type"] = "Err[api_key=sk-B6]"  # a hostile client's type name is text too
    scrub_exception(span, KEYS)
    assert "sk-B" not in orjson.dumps(span).decode()
    assert span["exception_info"]["traceback"][0]["filename"] == "/srv/app.py?api_key=REDACTED"


def test_secrets_nested_past_the_depth_bound_are_redacted_before_the_repr() -> None:
    # past TRACECAR_MAX_DEPTH a value is written as its repr: weave walks every level, so the
    # keys below are redacted first (a list, a dict, a tuple under the key)
    deep: object = {"api_key": ["pk-public", "sk-C1"], "auth": {"Authorization": {"primary": "sk-C2"}},
                    "t": ({"API_KEY": ("sk-C3",)},)}
    for _ in range(6):
        deep = {"d": deep}
    encoder = WireEncoder(max_depth=4, redact=KEYS)
    wire = {"span_id": "s", "trace_id": "s", "name": "op", "kind": "op", "start_time": 1.0, "end_time": 2.0,
            "attributes": {}, "inputs": {"config": deep}, "output": None, "exception": None}
    packed = pack_span(wire, encoder, 10**6).decode()
    assert "sk-C" not in packed and REDACTED in packed
    assert "pk-public" not in packed  # the whole value under the key, as weave replaces it


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([b'"api_key"', b'"API_Key"', b'"auth_headers"', b'"AUTHORIZATION"', b'api_key', b'"apikey"',
                                 b'"x"', b"1234,", b":", b"\\", b"\xc3\xa9", b'"authorization', b"{", b"}"]), max_size=12),
       st.sampled_from([(), ("X-Secret",), ("token[0]",)]))
def test_the_byte_search_finds_exactly_what_a_search_of_the_lower_cased_body_finds(pieces: list[bytes], extra: tuple[str, ...]) -> None:
    keys = RedactKeys(extra)
    body = b"".join(pieces)
    expected_json = any(b'"' + k.encode() + b'"' in body.lower() for k in keys.keys) or (
        (not body.isascii() or b"\\" in body) and keys._odd_key(body))
    assert keys.might_hold(body) == (expected_json or keys._always_walk)
    assert keys.might_hold(body, is_json=False) == (any(k.encode() in body.lower() for k in keys.keys) or keys._always_walk)


def test_a_non_finite_numpy_reward_travels_as_a_string_like_a_float_one() -> None:
    # np.float64 is a float: a NaN reward must keep its warning at the collector, not become null
    np = pytest.importorskip("numpy")
    wire = {"span_id": "s", "trace_id": "s", "name": "op", "kind": "op", "start_time": 1.0, "end_time": 2.0,
            "attributes": {"reward": np.float64("nan")}, "inputs": {}, "output": {"score": np.float64("inf"), "ok": np.float64(0.5)},
            "exception": None}
    sent = orjson.loads(pack_span(wire, WireEncoder(), 10**6))
    assert sent["attributes"]["reward"] == "nan" and sent["output"] == {"score": "inf", "ok": 0.5}


@pytest.mark.parametrize("extra", [(), ("x-api-key", "Password", "_", "123", "a")])
def test_the_letter_anchored_search_finds_exactly_what_the_quoted_key_regex_finds(extra) -> None:
    """_holds_quoted (memchr on each key's rarest letter) against the regex it replaces: random
    bodies with keys in any case, cut short, repeated past the per-body budget of places, inside a
    run of token ids long enough that the letters are searched (a short body goes to the regex)."""
    keys = RedactKeys(extra)
    regex = keys._quoted_re

    class CountedRegex:  # the letter search's own calls to the regex: its fall-backs past the budget
        calls = 0

        def search(self, body):
            CountedRegex.calls += 1
            return regex.search(body)

    keys._quoted_re = CountedRegex()
    rng = random.Random(7)
    alphabet = b'"_aAuUtThHpPiIkKeEyYzZoOrRnNdDsSwW-x:,{}[]0123456789 '
    ids = b"[" + b",".join(b"%d" % rng.randrange(150_000) for _ in range(800)) + b"]"
    assert len(ids) >= redact_module.REGEX_BELOW
    found = by_letters = 0
    for _ in range(6000):
        body = bytes(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        if rng.random() < 0.3:
            key = bytes(c if rng.random() < 0.5 else bytes([c]).upper()[0] for c in rng.choice(keys._quoted))
            key = key[:-1] if rng.random() < 0.3 else key
            at = rng.randint(0, len(body))
            body = body[:at] + key + body[at:]
        if rng.random() < 0.2:
            body = body * rng.randint(5, 400)  # many places of one letter: past the budget, the regex decides
        at = rng.randint(0, len(body))
        body = body[:at] + ids + body[at:]  # the ids may cut a key in two: the regex says what that is
        expected = regex.search(body) is not None
        found += expected
        before = CountedRegex.calls
        assert keys._holds_quoted(body) == expected, body[:200]
        by_letters += CountedRegex.calls == before
        assert keys._holds_quoted(bytearray(body)) == expected
    # both ways were exercised, and each gave the regex's answer
    assert found > 500 and by_letters > 1000 and CountedRegex.calls > 1000
