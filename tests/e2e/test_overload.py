"""Open-loop overload, CI-sized (loadtests/overload.py): a real server on loopback with the small buckets; its capacity
for the mix measured on the mix itself (answered per second of device time); Poisson arrivals at 0.7x of it (at most
1% refused), 4x (refused alike by kind, small requests still fast) and 0.5x (recovered), one bulk client beside them.
Each phase runs until its verdicts have their samples at the capacity this host calibrates (SAMPLES answers, and
every kind sent often enough that its fairness verdict could fail), and the run's verdicts judge counts beyond doubt
(loadtests/overload.py); the properties themselves are judged over simulated minutes in
tests/runtime/requests/test_scheduler_simulated.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.overload import LARGE, fair_sends
from runtime.settings import load_settings

pytestmark = [pytest.mark.slow, pytest.mark.timing, pytest.mark.timeout(1800)]
REPO = Path(__file__).resolve().parents[2]
SAMPLES = 30  # answers each latency verdict judges (loadtests/overload.py)


def test_open_loop_overload_is_answered_fast_or_refused_alike(tmp_path: Path, embedded_shaped_dir: Path) -> None:
    """On the embedded model's shapes with 2 of its 30 layers (tests/conftest.py embedded_shaped_dir): the same
    buckets, vocabulary head and tokenizer, the device still what limits the server, at ~5x the embedded model's
    requests per second on a 2-core CPU. Admission is what is judged here, and its verdicts need samples: on the
    embedded model a 2-core AVX2 EPYC answers ~1 request of the mix a second, and one kind sent 108 times under
    overload (fair_sends) took over 3 minutes."""
    command = [sys.executable, "-m", "loadtests.run", "--small-buckets", "--open-loop", "4", "--duration", "10",
               "--calibrate-s", "6", "--baseline", "0.7", "--baseline-s", "5", "--recovery", "0.5",
               "--recovery-s", "5", "--recover-within-s", "5", "--bulk-items", "256", "--samples", str(SAMPLES),
               "--max-phase-s", "400", "--reports-dir", str(tmp_path)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1800,
                            env={**os.environ, "SCOREFN_MODEL": str(embedded_shaped_dir)})
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
    # 0.7x: at most 1% refused beyond doubt (the verdict's: the load windows still remember the calibration at
    # capacity when the baseline starts, and one 32-item request of 60 was refused there once in five runs)
    assert phases["baseline"]["statuses"].get("429", 0) <= 0.05 * phases["baseline"]["sent"], phases["baseline"]
    overload = phases["overload"]
    assert overload["rate_per_s"] == pytest.approx(4 * summary["calibrated_rate_per_s"], rel=0.01)
    assert overload["statuses"]["429"] > 0 and overload["statuses"]["200"] > 0
    assert summary["latency_bound_s"] == summary["max_wait_s"] + max(summary["round_budget_s"], summary["round_p99_s"])
    # Enough small answers for the verdicts on their latency to be decided by the server, in every phase judged
    overloaded = summary["overloaded"]  # from when the server said it was overloaded
    assert min(window["bounded"]["answered"] for window in (phases["baseline"], overloaded,
                                                            summary["recovered"])) >= SAMPLES
    assert min(s["sent"] for name, s in overloaded["scenarios"].items() if name != "bulk") >= fair_sends(4)
    assert all("multiple_in_phase" in phase for phase in phases.values())
    assert {"score 1 item", "score 32 items", "rerank", "completions", "bulk"} <= {
        name for phase in phases.values() for name in phase["scenarios"]}
    assert summary["fairness"]["one_item_beside_bulk"]["answered"] > 0, "no one-item request ran beside a bulk one"
    assert summary["fairness"]["bulk"]["statuses"].get("200", 0) > 0, "the bulk client starved"
    # A bulk request that admission judges large, on every host: not one of the small requests it is fair to
    (items, own), limit = summary["bulk_sizes"][-1], LARGE * summary["max_wait_s"]
    assert own >= limit or items == load_settings().max_items, summary["bulk_sizes"]
    assert summary["server_exit_code"] == 0
    records = json.loads((tmp_path / "openloop.json").read_text())["records"]
    assert all(r["retry_after"] >= 1 for r in records if r["status"] == 429)
    assert all(r["predicted_device"] > 0 for r in records if r["status"] in (200, 429))  # admission's prediction
