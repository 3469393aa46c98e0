"""The load-test runner end to end, briefly: server on loopback, locust headless, reports, verdict."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timing]
REPO = Path(__file__).resolve().parents[2]


def test_a_short_load_test_passes_with_no_failures(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "loadtests.run", "--small-buckets", "--duration", "12", "--users", "3",
               "--spawn-rate", "3", "--max-p99-ms", "60000", "--reports-dir", str(tmp_path)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "PASSED" in result.stdout and "p99" in result.stdout and "req/s" in result.stdout

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["requests"] > 0 and summary["failures"] == 0 and summary["server_5xx"] == 0, summary
    assert summary["server_exit_code"] == 0 and summary["passed"]
    assert set(summary["server_timings_ms"]) == {"x-queue-time", "x-device-time", "x-total-time"}
    for report in ("loadtest.html", "loadtest_stats.csv", "loadtest_failures.csv", "locust.log"):
        assert (tmp_path / report).stat().st_size > 0, report

