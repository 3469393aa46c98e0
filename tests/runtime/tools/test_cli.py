"""`scorefn score` prints the documented Paris/London log-probabilities."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from runtime.tools.serverproc import SMALL_BUCKETS, scorefn_command

pytestmark = pytest.mark.slow


# The serve-only check's `scorefn score` runs with these buckets too: the executables it stored load here.
ENV = {**os.environ, **SMALL_BUCKETS}


def run_cli(*args: str) -> dict:
    out = subprocess.run(scorefn_command("score", *args), capture_output=True, text=True, check=True, env=ENV)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_score_with_token_ids_and_with_text_labels():
    by_ids = run_cli("--query", "The capital of France is", "--items", "", "--label-token-ids", "7042", "4528")
    paris, london = by_ids["scores"][0]
    assert paris == pytest.approx(-0.258, abs=1e-3) and london == pytest.approx(-4.384, abs=1e-3)
    by_text = run_cli("--query", "The capital of France is", "--labels", " Paris", " London")
    assert by_text["label_token_ids"] == [7042, 4528]
    assert by_text["scores"][0] == pytest.approx(by_ids["scores"][0], abs=1e-6)


def test_multi_token_label_is_refused():
    result = subprocess.run(scorefn_command("score", "--query", "x", "--labels", " antidisestablishment"),
                            capture_output=True, text=True, env=ENV)
    assert result.returncode != 0 and "not one" in result.stderr
    assert "loaded" not in result.stderr  # refused before the weights load
