"""loadtests.run's verdict: failures, the p99 bound and steady RSS growth in a soak fail a run."""

from __future__ import annotations

from pathlib import Path

import pytest

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
