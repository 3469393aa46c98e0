"""Open-loop overload, CI-sized (loadtests/overload.py): a real server on loopback with the small buckets; its capacity
for the mix measured on the mix itself (answered per second of device time); Poisson arrivals at 0.7x of it (nothing
refused), 4x (refused alike by kind, small requests still fast) and 0.5x (recovered), one bulk client beside them.
The run's own verdicts judge counts beyond doubt (loadtests/overload.py); the properties themselves are judged over
simulated minutes in tests/runtime/requests/test_scheduler_simulated.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timing]
REPO = Path(__file__).resolve().parents[2]


def test_open_loop_overload_is_answered_fast_or_refused_alike(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "loadtests.run", "--small-buckets", "--open-loop", "4", "--duration", "25",
               "--calibrate-s", "6", "--baseline", "0.7", "--baseline-s", "10", "--recovery", "0.5",
               "--recovery-s", "25", "--recover-within-s", "15", "--bulk-items", "256", "--reports-dir", str(tmp_path)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr[-3000:]
    assert result.returncode == 0 and "PASSED" in result.stdout, output

    summary = json.loads((tmp_path / "openloop_summary.json").read_text())
    phases = summary["phases"]
    assert set(phases) == {"calibrate", "baseline", "overload", "recovery"}
    statuses = {status for phase in phases.values() for s in phase["scenarios"].values() for status in s["statuses"]}
    assert statuses <= {"200", "429"}, statuses
    rates = summary["rates"]
    assert rates["server"] == pytest.approx(summary["calibrated_rate_per_s"], rel=0.01)
    assert rates["clients"] > 0 and rates["model"] > 0  # reported beside the server's
    assert phases["baseline"]["statuses"] == {"200": phases["baseline"]["sent"]}  # 0.7x: nothing refused
    overload = phases["overload"]
    assert overload["rate_per_s"] == pytest.approx(4 * summary["calibrated_rate_per_s"], rel=0.01)
    assert overload["statuses"]["429"] > 0 and overload["statuses"]["200"] > 0
    assert summary["latency_bound_s"] == summary["max_wait_s"] + max(summary["round_budget_s"], summary["round_p99_s"])
    assert overload["bounded"]["answered"] >= 30  # enough small answers for the verdict on their p99 to mean something
    assert {"score 1 item", "score 32 items", "rerank", "completions", "bulk"} <= {
        name for phase in phases.values() for name in phase["scenarios"]}
    assert summary["fairness"]["one_item_beside_bulk"]["answered"] > 0, "no one-item request ran beside a bulk one"
    assert summary["fairness"]["bulk"]["statuses"].get("200", 0) > 0, "the bulk client starved"
    assert summary["server_exit_code"] == 0
    records = json.loads((tmp_path / "openloop.json").read_text())["records"]
    assert all(r["retry_after"] >= 1 for r in records if r["status"] == 429)
    assert all(r["predicted_device"] > 0 for r in records if r["status"] in (200, 429))  # admission's prediction
