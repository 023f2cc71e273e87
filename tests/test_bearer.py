"""The one bearer-header parser behind the API's and the viewer's token checks."""

from __future__ import annotations

from tracecar.collector.bearer import bearer_matches, presented_bearer


def test_presented_bearer_takes_the_token_of_a_bearer_header_only() -> None:
    assert presented_bearer("Bearer abc") == "abc"
    assert presented_bearer("bearer   abc  ") == "abc"  # scheme is case-insensitive, spaces around the token ignored
    assert presented_bearer("Basic YXBpOmtleQ==") is None
    assert presented_bearer("") is None
    assert presented_bearer("Bearer") == ""


def test_bearer_matches_only_the_exact_token() -> None:
    token = b"s3cret-token"
    assert bearer_matches("Bearer s3cret-token", token)
    assert bearer_matches("BEARER s3cret-token", token)
    assert not bearer_matches("Bearer s3cret-tokenX", token)
    assert not bearer_matches("Bearer s3cret", token)
    assert not bearer_matches("Token s3cret-token", token)
    assert not bearer_matches("", token)
    assert not bearer_matches("Bearer é", token)  # non-ASCII presented value: no match, no exception
