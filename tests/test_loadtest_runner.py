"""loadtests.run's verdicts: failures, the p99 bound and steady RSS growth in a soak fail a run; the open-loop
run's latency bound is judged by its counts."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtests.overload import summarize
from loadtests.overload import verdict as open_loop_verdict
from loadtests.run import parse_args, report, slope_mb_per_min

SUMMARY = {
    "requests": 100, "failures": 0, "failure_ratio": 0.0, "duration_s": 10.0, "rps": 10.0,
    "p50_ms": 80.0, "p95_ms": 200.0, "p99_ms": 250.0, "max_ms": 260.0,
    "status_counts": {"200": 96, "400": 4}, "server_5xx": 0,
    "scenarios": {"classification": {"requests": 96, "p50_ms": 80.0, "p99_ms": 250.0},
                  "invalid empty_items": {"requests": 4, "p50_ms": 5.0, "p99_ms": 6.0}},
    "server_timings_ms": {"x-device-time": {"p50": 70.0, "p99": 200.0}},
}
WARM_THEN_FLAT = [(t * 5.0, 900 + min(t, 10) * 20.0) for t in range(40)]  # grows while warming up only
LEAKING = [(t * 5.0, 900 + t * 0.5) for t in range(40)]  # 0.5 MB every 5 s
ONE_STEP = [(t * 5.0, 900 + (30 if t >= 34 else 0)) for t in range(40)]  # +30 MB once, late in the run


def test_failures_and_the_p99_bound_fail_a_run(tmp_path: Path) -> None:
    args = parse_args(["--reports-dir", str(tmp_path)])
    assert args.duration == 60 and report(dict(SUMMARY), args, []) == []
    assert len(report({**SUMMARY, "failures": 2, "failure_ratio": 0.02}, args, [])) == 1
    strict = parse_args(["--max-p99-ms", "100", "--reports-dir", str(tmp_path)])
    assert report(dict(SUMMARY), strict, []) == ["p99 250 ms is over the bound of 100 ms"]


def test_rss_slope_ignores_warm_up_and_steps_and_sees_a_leak() -> None:
    assert slope_mb_per_min(WARM_THEN_FLAT) == pytest.approx(0.0)
    assert slope_mb_per_min(LEAKING) == pytest.approx(6.0)
    assert slope_mb_per_min(ONE_STEP) == 0.0  # a least-squares line would rise 23 MB/min
    assert slope_mb_per_min(LEAKING[:4]) == 0.0  # too few samples to judge


def test_a_soak_fails_on_steady_rss_growth(tmp_path: Path) -> None:
    args = parse_args(["--soak", "--reports-dir", str(tmp_path)])
    assert args.duration == 600
    summary = dict(SUMMARY)
    assert report(summary, args, WARM_THEN_FLAT) == []
    assert summary["rss_mb"]["start"] == 900 and summary["rss_mb"]["end"] == 1100
    assert report(dict(SUMMARY), args, LEAKING) == ["server RSS grows 6.00 MB/min over the second half (bound 1.0)"]


def open_loop_records(overload_latencies: list[float], recovery_refused: int = 0,
                      recovery_price: float = 0.05) -> dict:
    """An open-loop run's records: 20 quick answers in the calibration and each light phase (each priced
    0.05 s of device time by admission, the recovery's `recovery_price`), the given ones under 4x (plus refusals),
    and `recovery_refused` refusals after the backlog drained."""
    def record(phase: str, sent: float, latency: float, status: int = 200, price: float = 0.05) -> dict:
        return {"phase": phase, "scenario": "score 1 item", "sent": sent, "latency": latency, "status": status,
                "queue": 0.1, "device": 0.2, "predicted_queue": 0.1, "predicted_device": price}
    records = [record("calibrate", -10 + i * 0.5, 0.3) for i in range(20)]
    records += [record("baseline", i * 0.5, 0.3) for i in range(20)]
    records += [record("overload", 10 + i * 0.1, latency) for i, latency in enumerate(overload_latencies)]
    records += [record("overload", 10 + i * 0.1, 0.0, 429) for i in range(40)]
    records += [record("recovery", 40 + i * 0.5, 0.3, price=recovery_price) for i in range(20)]
    records += [record("recovery", 40.2 + i * 0.5, 0.0, 429, recovery_price) for i in range(recovery_refused)]
    return {"records": records, "rate": 2.0, "plan": {"multiple": 4.0, "baseline": 0.7, "recovery": 0.5},
            "phases": {"baseline": (0.0, 10.0), "overload": (10.0, 30.0), "overloaded": (10.0, 30.0),
                       "recovery": (30.0, 50.0), "settled": (40.0, 50.0)}}


def test_the_open_loop_verdict_judges_the_bounded_p99_by_its_counts() -> None:
    """The bound (SCOREFN_MAX_WAIT_S 2 s + a round budget of 0.3 s) is on the p99: two slow answers of 80 (one stall
    of a shared CPU) put the p99 over it but are not beyond doubt; ten of 80 are."""
    for slow, failed in ((0, False), (2, False), (10, True)):
        data = open_loop_records([3.0] * slow + [0.5] * (80 - slow))
        summary = summarize(data, max_wait_s=2.0, round_budget_s=0.3)
        assert summary["latency_bound_s"] == 2.3 and summary["phases"]["overload"]["bounded"]["over_bound"] == slow
        problems = open_loop_verdict(summary, data["records"], samples=20)
        assert any("took over SCOREFN_MAX_WAIT_S" in p for p in problems) == failed, problems


def test_refusals_after_the_drop_are_judged_where_the_recovery_is_light_at_the_device_s_speed_in_it() -> None:
    """Refusals after the backlog drained, more than 10% beyond doubt (12 of 32), fail a run at 0.5x the capacity;
    with the device 3x slower in the phase than in the calibration (admission's price of a one-item score), 0.5x is
    1.5x what it computes there, and refusing is its right."""
    for refused, price, failed in ((0, 0.05, False), (12, 0.05, True), (12, 0.15, False)):
        data = open_loop_records([0.5] * 80, recovery_refused=refused, recovery_price=price)
        summary = summarize(data, max_wait_s=2.0, round_budget_s=0.3)
        assert summary["recovered"]["statuses"].get("429", 0) == refused
        assert summary["phases"]["recovery"]["multiple_in_phase"] == pytest.approx(0.5 * price / 0.05)
        problems = open_loop_verdict(summary, data["records"], samples=20)
        assert any("after the backlog had drained, were refused" in p for p in problems) == failed, problems
