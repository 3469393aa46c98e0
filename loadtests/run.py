"""`make loadtest`: start `scorefn serve` on a loopback port, run the locust scenarios headless, judge the result.

    python -m loadtests.run                                  # 60 s, 4 users ramped up at 1 user/s
    python -m loadtests.run --small-buckets --duration 15    # a server that starts in seconds
    python -m loadtests.run --soak                           # 10 minutes, sampling the server's memory
    python -m loadtests.run --open-loop 4 --duration 300     # open-loop overload at 4x (loadtests/overload.py)

Writes locust's CSV and HTML reports, its log and summary.json under --reports-dir (loadtests/reports/), prints
p50/p95/p99, throughput and the failure ratio, and exits 1 if any request failed (a wrong status, body or
score, a refused connection), if p99 is over --max-p99-ms, or (with --soak) if the server's resident memory
grows steadily: the median slope of its RSS over the second half of the run above --max-rss-slope.
After the run the server gets SIGTERM and must exit 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from loadtests import overload
from loadtests.rss import RssSampler, slope_mb_per_min
from runtime.tools.serverproc import SMALL_BUCKETS, ServerProcess

HERE = Path(__file__).resolve().parent
# The ranking query's length in words (one token each): query + item must fit the longest length bucket.
QUERY_WORDS = {"small": 40, "default": 200}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtests.run", description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, help="seconds of load (default 60; 600 with --soak)")
    parser.add_argument("--users", type=int, default=4, help="concurrent simulated clients (default 4)")
    parser.add_argument("--spawn-rate", type=float, default=1.0, help="users started per second: the ramp")
    parser.add_argument("--max-p99-ms", type=float, default=10000.0, help="fail if p99 latency (ms) is above this")
    parser.add_argument("--small-buckets", action="store_true",
                        help="serve with the test suite's small shape buckets (starts in seconds; 64-token limit)")
    parser.add_argument("--soak", action="store_true", help="a long run that also checks the server's memory")
    parser.add_argument("--rss-interval", type=float, default=5.0, help="seconds between RSS samples")
    parser.add_argument("--max-rss-slope", type=float, default=1.0,
                        help="MB per minute of RSS growth over the second half of a soak that fails it")
    parser.add_argument("--reports-dir", type=Path, default=HERE / "reports")
    open_loop = parser.add_argument_group("open loop (loadtests/overload.py); --duration is the overload phase")
    open_loop.add_argument("--open-loop", type=float, metavar="MULTIPLE",
                           help="Poisson arrivals at MULTIPLE x the rate measured by the calibration phase")
    open_loop.add_argument("--clients", type=int, default=8, help="closed-loop clients of the calibration phase")
    open_loop.add_argument("--calibrate-s", type=float, default=10.0,
                           help="seconds of calibration (closed-loop clients keep the device busy: its capacity)")
    open_loop.add_argument("--rate", type=float, help="requests of the mix per second to take as the capacity "
                           "(no calibration)")
    open_loop.add_argument("--baseline", type=float, default=0.5, help="multiple of the rate before the overload")
    open_loop.add_argument("--baseline-s", type=float, default=15.0,
                           help="seconds at --baseline before the overload (at least)")
    open_loop.add_argument("--recovery", type=float, help="multiple of the rate after the overload (default: --baseline)")
    open_loop.add_argument("--recovery-s", type=float, default=30.0,
                           help="seconds at --recovery once the backlog has drained (at least)")
    open_loop.add_argument("--recover-within-s", type=float, default=10.0,
                           help="latency must be normal again this long after the overload ends, at the latest once "
                           "the backlog has drained")
    open_loop.add_argument("--bulk-items", type=int, default=1024,
                           help="items of each request of the bulk client (0: no bulk client)")
    open_loop.add_argument("--samples", type=int, default=30,
                           help="answers each latency verdict judges: a phase runs past its seconds until it has them")
    open_loop.add_argument("--max-phase-s", type=float, default=600.0, help="the longest a phase runs")
    args = parser.parse_args(argv)
    if args.duration is None:
        args.duration = 600.0 if args.soak else 60.0
    return args


def run_locust(url: str, args: argparse.Namespace, query_words: int) -> dict:
    reports = args.reports_dir
    summary_path = reports / "summary.json"
    summary_path.unlink(missing_ok=True)
    command = [sys.executable, "-m", "locust", "-f", str(HERE / "locustfile.py"), "--headless", "--host", url,
               "--users", str(args.users), "--spawn-rate", str(args.spawn_rate), "--run-time", f"{args.duration:g}s",
               "--stop-timeout", "60", "--only-summary", "--csv", str(reports / "loadtest"),
               "--html", str(reports / "loadtest.html"), "--exit-code-on-error", "0"]
    env = {**os.environ, "LOADTEST_QUERY_WORDS": str(query_words), "LOADTEST_SUMMARY": str(summary_path)}
    with open(reports / "locust.log", "w") as log:
        subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.duration + 180,
                       check=True)
    return json.loads(summary_path.read_text())


def report(summary: dict, args: argparse.Namespace, rss: list[tuple[float, float]]) -> list[str]:
    """Prints the summary; returns the reasons the run failed (none: passed)."""
    print(f"requests {summary['requests']}  failures {summary['failures']} "
          f"({summary['failure_ratio']:.2%})  5xx {summary['server_5xx']}  "
          f"throughput {summary['rps']:.1f} req/s over {summary['duration_s']:.0f} s")
    print(f"latency ms  p50 {summary['p50_ms']:.0f}  p95 {summary['p95_ms']:.0f}  p99 {summary['p99_ms']:.0f}  "
          f"max {summary['max_ms']:.0f}")
    for name, scenario in summary["scenarios"].items():
        print(f"  {name:40} {scenario['requests']:6d}  p50 {scenario['p50_ms']:7.0f}  p99 {scenario['p99_ms']:7.0f}")
    for header, timing in summary["server_timings_ms"].items():
        print(f"  server {header:33} p50 {timing['p50']:7.1f}  p99 {timing['p99']:7.1f}")
    print(f"statuses {summary['status_counts']}")
    problems = []
    if summary["requests"] == 0:
        problems.append("no requests were made")
    if summary["failures"]:
        problems.append(f"{summary['failures']} requests failed (see {args.reports_dir / 'loadtest_failures.csv'})")
    if summary["p99_ms"] > args.max_p99_ms:
        problems.append(f"p99 {summary['p99_ms']:.0f} ms is over the bound of {args.max_p99_ms:g} ms")
    if rss:
        slope = slope_mb_per_min(rss)
        summary["rss_mb"] = {"start": rss[0][1], "end": rss[-1][1], "max": max(m for _, m in rss),
                             "second_half_slope_mb_per_min": slope,
                             "samples": [[round(t, 1), round(m, 1)] for t, m in rss]}
        print(f"server RSS MB  start {rss[0][1]:.0f}  end {rss[-1][1]:.0f}  max {summary['rss_mb']['max']:.0f}  "
              f"second-half slope {slope:+.2f} MB/min ({len(rss)} samples)")
        if slope > args.max_rss_slope:
            problems.append(f"server RSS grows {slope:.2f} MB/min over the second half (bound {args.max_rss_slope})")
    return problems


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.reports_dir.mkdir(parents=True, exist_ok=True)
    env = dict(SMALL_BUCKETS) if args.small_buckets else {}
    query_words = QUERY_WORDS["small" if args.small_buckets else "default"]
    if args.open_loop is not None:
        return overload.run(args, env, query_words)
    print(f"starting scorefn serve ({'small' if args.small_buckets else 'configured'} buckets) ...", flush=True)
    started = time.monotonic()
    server = ServerProcess(env=env)
    print(f"ready at {server.url} after {time.monotonic() - started:.1f} s; {args.users} users "
          f"(+{args.spawn_rate:g}/s) for {args.duration:g} s", flush=True)
    rss: list[tuple[float, float]] = []
    try:
        if args.soak:
            with RssSampler(server.proc.pid, args.rss_interval) as sampler:
                summary = run_locust(server.url, args, query_words)
            rss = sampler.samples
        else:
            summary = run_locust(server.url, args, query_words)
    finally:
        exit_code = server.stop()
    problems = report(summary, args, rss)
    if exit_code != 0:
        problems.append(f"the server exited {exit_code} after SIGTERM")
    summary.update(server_exit_code=exit_code, passed=not problems, problems=problems)
    (args.reports_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"reports: {args.reports_dir}/loadtest.html, loadtest_stats.csv, summary.json")
    for problem in problems:
        print(f"FAILED: {problem}")
    print("PASSED" if not problems else "FAILED")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
