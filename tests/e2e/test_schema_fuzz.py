"""schemathesis against the OpenAPI schema a real server serves: every operation, valid and invalid data.

Checks: no 5xx, responses (status, content type, headers, body) as the schema documents them, schema-invalid
requests rejected, and every error in the RFC-006 envelope. Bounded: a few dozen examples per operation and mode
(fuzzing, driven by Hypothesis here: schemathesis' own pytest integration, `from_fixture`, does not run on this
pytest), then schemathesis' CLI for its coverage phase (boundary values, missing fields, unsupported methods).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from handler.core import ENDPOINTS
from runtime.tools.serverproc import ServerProcess
from tests.e2e.conftest import FUNCTIONAL

pytestmark = pytest.mark.slow
EXAMPLES = 100  # per operation and generation mode
# An alias (the same Endpoint under another path: /v2/rerank, /rerank) runs the code its first path runs: fewer
# examples prove the route, the first path's hundred fuzz the endpoint.
ALIAS_EXAMPLES = 15
OPERATIONS = [(endpoint.method, path) for path, endpoint in ENDPOINTS.items()]
ALIASES = {path for path, endpoint in ENDPOINTS.items()
           if next(first for first, other in ENDPOINTS.items() if other is endpoint) != path}
CASES = [(method, path, mode) for method, path in OPERATIONS
         for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
         if mode.is_positive or ENDPOINTS[path].request is not None]  # nothing to get wrong without a body
# Schema-valid bodies may still be refused, by rules a JSON Schema cannot state. /v1/score: query and items of
# one mode, IDs below the model's vocabulary, sequences within the longest bucket, no integral floats (1.0);
# /v1/classify: `model` must name a configured classifier; rerank: `model` must name a reranker, a query of
# whitespace only is empty, pairs within the longest bucket; /v1/completions: prompt IDs below the vocabulary,
# prompts within the longest bucket, no integral floats (max_tokens 1.0: JSON Schema's "integer" admits it).
MAY_REFUSE_VALID = {"/v1/score", "/v1/classify", "/v1/rerank", "/v2/rerank", "/rerank", "/v1/completions"}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    """What is fuzzed is the HTTP contract (schemas, statuses, envelopes), not the model's numbers: a tiny Llama with
    SmolLM2's vocabulary and tokenizer answers every endpoint as the embedded model does (the built-in classifier
    and reranker included), each scored request in milliseconds rather than the 30 layers' ~0.3 s."""
    with ServerProcess(env={**FUNCTIONAL, "SCOREFN_MODEL": str(tiny_llama_dir)}) as process:
        yield process


@pytest.fixture(scope="module")
def served_schema(server):
    return schemathesis.openapi.from_url(server.url + "/schema/openapi.json", timeout=30)


def test_the_schema_documents_every_endpoint(served_schema):
    documented = {(op.method.upper(), op.path) for op in (r.ok() for r in served_schema.get_all_operations())}
    assert documented == set(OPERATIONS)


@pytest.mark.parametrize(("method", "path", "mode"), CASES, ids=[f"{m} {p} {g}" for m, p, g in CASES])
def test_operation(served_schema, method: str, path: str, mode: GenerationMode):
    operation = served_schema[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=ALIAS_EXAMPLES if path in ALIASES else EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case):
        response = case.call(timeout=60)
        assert response.status_code < 500, response.text
        case.validate_response(response, excluded_checks=[positive_data_acceptance] if path in MAY_REFUSE_VALID
                               else None)
        if response.status_code >= 400:
            envelope = response.json()
            assert set(envelope) == {"error"}, envelope
            assert set(envelope["error"]) == {"message", "type", "param", "code"}, envelope

    check()


def test_coverage_phase_with_the_cli(server, tmp_path):
    repo = Path(__file__).resolve().parents[2]
    command = [str(Path(sys.executable).parent / "schemathesis"), "--no-color", "run",
               server.url + "/schema/openapi.json", "--phases", "coverage", "--checks", "all",
               # schema-valid bodies may be refused (MAY_REFUSE_VALID); the fuzzing tests check the rest
               "--exclude-checks", "positive_data_acceptance", "--request-timeout", "60",
               "--generation-database", "none", "--seed", "1"]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.e2e.schemathesis_hooks", "PYTHONPATH": str(repo)}
    # its cache goes to the working directory
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "No issues found" in result.stdout
