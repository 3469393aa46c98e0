"""`python -m loadtests.repeat --runs 20 [--busy]`: the timing tests (`pytest -m timing`: overload, load, SIGTERM and
drain) run again and again, alone or beside a CPU-bound process (one busy loop per --busy), to show that their
verdicts are decided by the server, not by chance, on this host: prints each run's outcome, the overload run's
sample counts per verdict and the multiple of the device's speed each phase ran at, and exits 1 if any run failed.
Each run's files stay under --dir (pytest's --basetemp, one per run).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def busy_loop() -> None:
    while True:
        pass


def overload_counts(run_dir: Path) -> str:
    """The overload run's samples per verdict, from its summary (none: the test did not get that far)."""
    summaries = sorted(run_dir.rglob("openloop_summary.json"))
    if not summaries:
        return "no overload summary"
    summary = json.loads(summaries[-1].read_text())
    phases, recovered, overloaded = summary["phases"], summary.get("recovered", {}), summary.get("overloaded", {})
    fewest = min((s["sent"] for name, s in overloaded.get("scenarios", {}).items() if name != "bulk"), default=0)
    return (f"capacity {summary['calibrated_rate_per_s']:.2f}/s; answered one-item and completions: baseline "
            f"{phases['baseline']['bounded']['answered']}, overloaded "
            f"{overloaded.get('bounded', {}).get('answered', 0)}, "
            f"recovered {recovered.get('bounded', {}).get('answered', 0)}; fewest of a kind sent under overload "
            f"{fewest}; multiples in phase " + ", ".join(f"{name} {p['multiple_in_phase']:.2f}"
                                                         for name, p in phases.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.repeat", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--busy", type=int, default=0, help="CPU-bound processes beside the tests")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/scorefn-timing-runs"))
    parser.add_argument("pytest_args", nargs="*", help="more arguments for pytest (e.g. a test's node id)")
    args = parser.parse_args(argv)
    busy = [multiprocessing.Process(target=busy_loop, daemon=True) for _ in range(args.busy)]
    for process in busy:
        process.start()
    failed = 0
    try:
        for run in range(1, args.runs + 1):
            run_dir = args.dir / f"run-{run}"
            started = time.monotonic()
            done = subprocess.run([sys.executable, "-m", "pytest", "-m", "timing", "-p", "no:cacheprovider", "-q",
                                   f"--basetemp={run_dir}", *args.pytest_args], cwd=REPO, capture_output=True,
                                  text=True)
            failed += done.returncode != 0
            outcome = "passed" if done.returncode == 0 else "FAILED"
            print(f"run {run:2d}: {outcome} in {time.monotonic() - started:.0f} s; {overload_counts(run_dir)}",
                  flush=True)
            if done.returncode != 0:
                (args.dir / f"run-{run}.log").write_text(done.stdout + done.stderr)
                print("\n".join(line for line in done.stdout.splitlines() if "FAILED" in line or "Error" in line),
                      flush=True)
    finally:
        for process in busy:
            process.terminate()
    print(f"{args.runs - failed} of {args.runs} runs passed" + (f" beside {args.busy} busy loop(s)" if busy else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
