"""A schemathesis check loaded by the CLI run in test_schema_fuzz (SCHEMATHESIS_HOOKS=tests.e2e.schemathesis_hooks)."""

from __future__ import annotations

import schemathesis


@schemathesis.check
def rfc006_envelope(ctx, response, case) -> None:
    """Every error is {"error": {"message", "type", "param", "code"}} (RFC-006), never a framework's own body."""
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"}, body
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
