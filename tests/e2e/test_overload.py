"""Open-loop overload, CI-sized (loadtests/overload.py): a real server on loopback with the small buckets; Poisson
arrivals at 4x the rate measured in the same run for 20 s, between half-rate phases, one bulk client beside them.
Only 200 and 429 come back; answered small requests stay within SCOREFN_MAX_WAIT_S plus one device round; latency is
back to normal within 10 s after the load drops."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def test_open_loop_overload_is_answered_fast_or_refused(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "loadtests.run", "--small-buckets", "--open-loop", "4", "--duration", "20",
               "--calibrate-s", "8", "--baseline-s", "10", "--recovery-s", "20", "--bulk-items", "256",
               "--reports-dir", str(tmp_path)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr[-3000:]
    assert result.returncode == 0 and "PASSED" in result.stdout, output

    summary = json.loads((tmp_path / "openloop_summary.json").read_text())
    phases = summary["phases"]
    assert set(phases) == {"calibrate", "baseline", "overload", "recovery"}
    statuses = {status for phase in phases.values() for s in phase["scenarios"].values() for status in s["statuses"]}
    assert statuses <= {"200", "429"}, statuses
    overload = phases["overload"]
    assert overload["rate_per_s"] == pytest.approx(4 * summary["calibrated_rate_per_s"], rel=0.01)
    assert overload["statuses"]["429"] > 0 and overload["statuses"]["200"] > 0
    assert overload["bounded"]["p99_s"] <= summary["max_wait_s"] + max(summary["round_budget_s"],
                                                                       summary["round_p99_s"])
    assert {"score 1 item", "score 32 items", "rerank", "completions", "bulk"} <= {
        name for phase in phases.values() for name in phase["scenarios"]}
    assert summary["fairness"]["one_item_beside_bulk"]["answered"] > 0, "no one-item request ran beside a bulk one"
    assert summary["server_exit_code"] == 0
    records = json.loads((tmp_path / "openloop.json").read_text())["records"]
    assert all(r["retry_after"] >= 1 for r in records if r["status"] == 429)
