"""`python -m loadtests.run --open-loop MULTIPLE`: the open-loop overload run (loadtests/openloop.py), judged.

Starts `scorefn serve` on a loopback port, runs the plan (calibrate, baseline, overload at MULTIPLE x the server's
measured capacity for the mix, recovery), samples the server's RSS, then writes under --reports-dir: openloop.json
(every request), openloop_summary.json (the rates: the server's capacity, the calibrating clients' rate and the
service model's; per phase and kind: answered, refused, p50/p99, predicted against measured queue and device time,
the answered share of each kind; the phase's multiple of what the device computed in it; a timeline; RSS),
server.log and locust's CSV/HTML. Each phase runs until its verdicts have their samples (--samples answers, and every
kind sent often enough for its fairness verdict to fail: fair_sends); the run fails if
- any answer is not a checked 200 or a 429 with its Retry-After, or a phase could not gather its samples,
- the baseline (up to LIGHT (0.7) x capacity, and so in the phase's own device time) refused more than
  LIGHT_REFUSALS of the mix, beyond doubt; after the overload, once the backlog was back to the baseline's, more than
  RECOVERED_REFUSALS, beyond doubt (or the backlog never got back),
- the overload phase (above 1x) refused nothing; more than 1% of its answered one-item scores and completions
  (requests small enough for the admission to bound their latency: their p99) took longer than SCOREFN_MAX_WAIT_S
  plus one device round (the p99 of the one-item requests' x-device-time, at least the round budget), beyond doubt;
  or a kind of the mix was answered at less than half the mix's share, beyond doubt,
- the one-item scores and completions sent after the backlog drained were slower than normal (the baseline's p50
  x1.5, or plus two round budgets) more than half the time (their p50), or more than 1% of them over the bound above,
  beyond doubt,
- the bulk client was never answered, the server does not exit 0 on SIGTERM, or (--soak) its RSS grows steadily.
"Beyond doubt": the counts make the outcome less likely than 1 in 1,000 if the bound held (a one-sided binomial
test), so a handful of requests never decides a run: a p99 of 80 answers is their slowest one or two, and a single
stall of a shared CPU (a round that overran its prediction fivefold beside another busy process) would decide it.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from loadtests.rss import RssSampler, slope_mb_per_min
from runtime.settings import load_settings
from runtime.tools.serverproc import ServerProcess

HERE = Path(__file__).resolve().parent
SMALL = ("score 1 item",)  # the requests whose latency shows fairness against the bulk client
# Small requests (own work within half of SCOREFN_MAX_WAIT_S): admission bounds their latency (budget + one round).
BOUNDED = ("score 1 item", "completions")
TIMELINE_S = 5.0
LIGHT = 0.7  # up to this multiple of the capacity, no request of the mix may be refused
RECOVERED_REFUSALS = 0.1  # the most refused after the load has dropped (a burst may meet the overload's backlog)
DOUBT = 1e-3  # a verdict on counts fails only when the outcome is less likely than this under the bound
TAIL = 0.01  # the share of bounded answers allowed over the latency bound (the bound is on their p99)
# The bulk client's requests: own device time at least this x SCOREFN_MAX_WAIT_S, 1.5x admission's bound on a small
# one (half of it), past the service model's drift within a run (~20%: 0.86-1.03 s for one size, 2026-12-07).
LARGE = 0.75
LIGHT_REFUSALS = 0.01  # the most refused of the mix at up to LIGHT x the capacity (a burst of arrivals may fill
# the promise to small requests), beyond doubt


def fair_sends(multiple: float) -> int:
    """Requests of one kind to send at `multiple` x the capacity for its fairness verdict (answered at least half the
    mix's share) to be able to fail: the mix's answered share is about 1 / multiple less the bulk client's (taken as
    half of it), and none of n answered at half of that must be less likely than DOUBT."""
    half = min(0.5, 0.25 / max(multiple, 1.0))
    return math.ceil(math.log(DOUBT) / math.log(1 - half))


def plan(args: argparse.Namespace, query_words: int, max_items: int = 0) -> dict[str, Any]:
    """The load driver's plan (loadtests/openloop.py); `max_items`: the server's SCOREFN_MAX_ITEMS, the most items
    the bulk client grows its requests to."""
    return {"clients": args.clients, "calibrate_s": args.calibrate_s, "baseline": args.baseline,
            "bulk_max_items": max(max_items, args.bulk_items),
            "recovery": args.baseline if args.recovery is None else args.recovery,
            "baseline_s": args.baseline_s, "multiple": args.open_loop, "overload_s": args.duration,
            "recovery_s": args.recovery_s, "bulk_items": args.bulk_items, "query_words": query_words, "seed": 0,
            "rate": args.rate or 0.0, "samples": args.samples, "max_phase_s": args.max_phase_s,
            "recover_within_s": args.recover_within_s}


def run_locust(url: str, args: argparse.Namespace, query_words: int, max_items: int) -> dict[str, Any]:
    reports = args.reports_dir
    records_path = reports / "openloop.json"
    records_path.unlink(missing_ok=True)
    steps = args.calibrate_s + 3 * args.max_phase_s  # each phase runs until its verdicts have their samples
    command = [sys.executable, "-m", "locust", "-f", str(HERE / "openloop.py"), "--headless", "--host", url,
               "--users", "1", "--spawn-rate", "1", "--run-time", f"{steps + 300:g}s", "--stop-timeout", "30",
               "--only-summary", "--csv", str(reports / "openloop"), "--html", str(reports / "openloop.html"),
               "--exit-code-on-error", "0"]
    env = {**os.environ, "OPENLOOP_PLAN": json.dumps(plan(args, query_words, max_items)),
           "OPENLOOP_RECORDS": str(records_path)}
    with open(reports / "openloop_locust.log", "w") as log:
        subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=steps + 600, check=True)
    return json.loads(records_path.read_text())


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values), as loadtests/locustfile.py computes it."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return 0.0
    ordered = sorted(values)
    return round(ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)], 4)


def latency(records: list[dict], q: float) -> float:
    return percentile([r["latency"] for r in records if r["status"] == 200], q)


def binomial_tail(k: int, n: int, p: float, upper: bool) -> float:
    """P(X >= k) (upper) or P(X <= k) of X ~ Binomial(n, p)."""
    p = min(max(p, 0.0), 1.0)
    terms = range(k, n + 1) if upper else range(0, k + 1)
    return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in terms)


def describe(records: list[dict], seconds: float) -> dict[str, Any]:
    statuses: dict[str, int] = {}
    for r in records:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    answered = statuses.get("200", 0)
    ok = [r for r in records if r["status"] == 200]
    return {"sent": len(records), "statuses": dict(sorted(statuses.items())),
            "answered_per_s": round(answered / seconds, 2) if seconds > 0 else 0.0,
            "answered_share": round(answered / len(records), 4) if records else 0.0,
            "refused_ratio": round(statuses.get("429", 0) / len(records), 4) if records else 0.0,
            "refusals": dict(sorted(collections.Counter(r["refusal"] for r in records if "refusal" in r).items())),
            "p50_s": latency(records, 50), "p99_s": latency(records, 99), "max_s": latency(records, 100),
            # what admission predicted beside what happened (answered requests), and for the refused ones
            "predicted_queue_p50_s": percentile([r.get("predicted_queue", math.nan) for r in ok], 50),
            "queue_p50_s": percentile([r.get("queue", math.nan) for r in ok], 50),
            "predicted_device_p50_s": percentile([r.get("predicted_device", math.nan) for r in ok], 50),
            "device_p50_s": percentile([r.get("device", math.nan) for r in ok], 50),
            "refused_predicted_queue_p50_s": percentile(
                [r.get("predicted_queue", math.nan) for r in records if r["status"] == 429], 50)}


def server_limits(url: str) -> tuple[float, float]:
    """The server's SCOREFN_MAX_WAIT_S and round budget as it runs them (auto: from its calibration), from /metrics."""
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        values[name] = value
    return float(values["scorefn_engine_max_wait_seconds"]), float(values["scorefn_engine_round_budget_seconds"])


def summarize(data: dict[str, Any], max_wait_s: float, round_budget_s: float) -> dict[str, Any]:
    records, bounds = data["records"], data["phases"]
    # One device round, as they ran: a one-item request is computed in a single round, its x-device-time.
    rounds = [r["device"] for r in records
              if r["phase"] == "overload" and r["scenario"] in SMALL and r["status"] == 200]
    summary: dict[str, Any] = {"calibrated_rate_per_s": round(data["rate"], 2),
                               "rates": {k: round(v, 3) for k, v in data.get("rates", {}).items()},
                               "multiple": data["plan"]["multiple"], "max_wait_s": max_wait_s,
                               "round_budget_s": round_budget_s, "bulk_sizes": data.get("bulk_sizes", []),
                               "round_p99_s": percentile(rounds, 99),
                               "phases": {}}
    # The bound on the bounded requests' p99: SCOREFN_MAX_WAIT_S plus one device round.
    summary["latency_bound_s"] = bound = max_wait_s + max(summary["round_budget_s"], summary["round_p99_s"])

    def bounded(records: list[dict], seconds: float) -> dict[str, Any]:
        mine = [r for r in records if r["scenario"] in BOUNDED]
        return describe(mine, seconds) | {
            "answered": sum(r["status"] == 200 for r in mine),
            "over_bound": sum(r["status"] == 200 and r["latency"] > bound for r in mine)}

    price = one_item_price(records, "calibrate")
    for phase, (start, end) in bounds.items():
        if phase in ("settled", "overloaded"):
            continue
        mine = [r for r in records if r["phase"] == phase]
        mix = [r for r in mine if r["scenario"] != "bulk"]
        multiple = _multiple(data["plan"], phase)
        # The device's speed in the phase against the calibration's: what the service model (refit to the last
        # rounds) priced a one-item request at. A host made busy by another process is slower: the same rate is then
        # a larger multiple of what the device computes in the phase.
        slowdown = one_item_price(records, phase) / price if price else 1.0
        summary["phases"][phase] = {
            "seconds": round(end - start, 1), "multiple": multiple, "slowdown": round(slowdown, 3),
            "multiple_in_phase": round(multiple * slowdown, 3),
            "rate_per_s": round(data["rate"] * multiple, 2),
            **describe(mix, end - start),
            "bounded": bounded(mine, end - start),
            "scenarios": {name: describe([r for r in mine if r["scenario"] == name], end - start)
                          for name in sorted({r["scenario"] for r in mine})}}
    if "overloaded" in bounds:  # from when the server said it was overloaded (before, the arrivals are a burst)
        start, end = bounds["overloaded"]
        mine = [r for r in records if r["phase"] == "overload" and r["sent"] >= start]
        mix = [r for r in mine if r["scenario"] != "bulk"]
        summary["overloaded"] = {"from_s": round(start, 1), **describe(mix, end - start),
                                 "bounded": bounded(mine, end - start),
                                 "scenarios": {name: describe([r for r in mine if r["scenario"] == name], end - start)
                                               for name in sorted({r["scenario"] for r in mine})}}
    if "settled" in bounds:
        # From when the server's backlog was back to the baseline's (the overload's work done), as the load driver
        # polled it, and --recover-within-s after the drop.
        settled = bounds["settled"][0]
        late = [r for r in records if r["phase"] == "recovery" and r["sent"] >= settled and r["scenario"] != "bulk"]
        summary["recovered"] = {"from_s": round(settled, 1), **describe(late, bounds["recovery"][1] - settled),
                                "bounded": bounded(late, bounds["recovery"][1] - settled)}
        if "baseline" in summary["phases"]:
            # Normal: the baseline's p50, with slack (rounds of large work may run beside them, or not, in either
            # phase); their p50 is judged by how many are over it.
            base = summary["phases"]["baseline"]["bounded"]["p50_s"]
            normal = summary["recovered"]["normal_s"] = max(1.5 * base, base + 2 * summary["round_budget_s"])
            summary["recovered"]["bounded"]["over_normal"] = sum(
                r["status"] == 200 and r["scenario"] in BOUNDED and r["latency"] > normal for r in late)
    summary["timeline"] = timeline(records)
    summary["fairness"] = fairness(records)
    return summary


def one_item_price(records: list[dict], phase: str) -> float:
    """The median device seconds admission predicted for the one-item scores answered in a phase (0: none)."""
    prices = sorted(r["predicted_device"] for r in records
                    if r["phase"] == phase and r["scenario"] in SMALL and r["status"] == 200
                    and not math.isnan(r.get("predicted_device", math.nan)))
    return prices[len(prices) // 2] if prices else 0.0


def _multiple(plan: dict[str, Any], phase: str) -> float:
    return {"calibrate": 1.0, "baseline": plan["baseline"], "overload": plan["multiple"],
            "recovery": plan.get("recovery", plan["baseline"])}[phase]


def timeline(records: list[dict]) -> list[dict[str, Any]]:
    """Per TIMELINE_S window of sending time (bulk aside): sent, answered, refused, answered p50/p99."""
    windows: dict[int, list[dict]] = {}
    for r in records:
        if r["scenario"] != "bulk":
            windows.setdefault(int(r["sent"] // TIMELINE_S), []).append(r)
    return [{"t": k * TIMELINE_S, "phase": rs[0]["phase"], "sent": len(rs),
             "answered": sum(r["status"] == 200 for r in rs), "refused": sum(r["status"] == 429 for r in rs),
             "p50_s": latency(rs, 50), "p99_s": latency(rs, 99)} for k, rs in sorted(windows.items())]


def fairness(records: list[dict]) -> dict[str, Any]:
    """One-item requests answered while a bulk request was being computed, against those answered without one."""
    bulk = [(r["sent"], r["sent"] + r["latency"]) for r in records if r["scenario"] == "bulk" and r["status"] == 200]
    small = [r for r in records if r["scenario"] in SMALL and r["status"] == 200]
    beside = [r for r in small if any(s < r["sent"] + r["latency"] and r["sent"] < e for s, e in bulk)]
    alone = [r for r in small if r not in beside]
    bulk_records = [r for r in records if r["scenario"] == "bulk"]
    return {"bulk": describe(bulk_records, 1.0) | {"answered_per_s": None},
            "one_item_beside_bulk": answered(beside), "one_item_alone": answered(alone)}


def answered(records: list[dict]) -> dict[str, Any]:
    return {"answered": len(records), "p50_s": latency(records, 50), "p99_s": latency(records, 99)}


def verdict(summary: dict[str, Any], records: list[dict], samples: int) -> list[str]:
    problems = []
    wrong = [r for r in records if r["status"] not in (200, 429) or "problem" in r]
    if wrong:
        problems.append(f"{len(wrong)} answers were neither a checked 200 nor a 429 with Retry-After, e.g. {wrong[0]}")
    phases = summary["phases"]
    counts = {"baseline": phases["baseline"]["bounded"]["answered"]} if "baseline" in phases else {}
    for name, window in (("overload", "overloaded"), ("recovery", "recovered")):
        if window in summary:
            counts[name] = summary[window]["bounded"]["answered"]
    for name, counted in counts.items():  # each verdict judges `samples` answers at least
        if counted < samples:
            problems.append(f"the {name} phase answered {counted} one-item scores and completions, fewer than the "
                            f"{samples} its verdicts judge (it ran its longest: --max-phase-s)")
    baseline = phases.get("baseline")
    if baseline and baseline["multiple"] <= LIGHT:
        refused = baseline["statuses"].get("429", 0)
        # Judged at the multiple of what the device computed in the phase: a host slowed by another process past
        # LIGHT may refuse (its right), and says so.
        if baseline["multiple_in_phase"] <= LIGHT * 1.2 and \
                binomial_tail(refused, baseline["sent"], LIGHT_REFUSALS, upper=True) < DOUBT:
            problems.append(f"{refused} of {baseline['sent']} requests of the mix were refused at "
                            f"{baseline['multiple']:g}x the capacity ({baseline['multiple_in_phase']:.2f}x what the "
                            f"device computed in the phase): over {LIGHT_REFUSALS:.0%}, beyond doubt")
    if "overload" in phases and phases["overload"]["multiple"] > 1 and "overloaded" not in summary:
        problems.append(f"the server never said it was overloaded (its load over 1) at "
                        f"{phases['overload']['multiple_in_phase']:.2f}x what the device computed in the phase")
    elif "overload" in phases and phases["overload"]["multiple"] > 1:
        overload = summary["overloaded"]  # from when the server said so
        if overload["statuses"].get("429", 0) == 0:
            problems.append(f"the overload phase refused nothing at {phases['overload']['multiple_in_phase']:.2f}x "
                            f"what the device computed in it: it did not overload the server")
        problems += over_tail(overload["bounded"], "under overload", summary)
        for name, s in overload["scenarios"].items():
            fair = overload["answered_share"] / 2  # at least half the mix's share of answers
            if name != "bulk" and binomial_tail(s["statuses"].get("200", 0), s["sent"], fair, upper=False) < DOUBT:
                problems.append(f"{name} was answered for {s['answered_share']:.1%} of its requests under overload, "
                                f"under half the mix's {overload['answered_share']:.1%} ({s['sent']} sent)")
    if "recovery" in phases and "recovered" not in summary:
        problems.append(f"the backlog never drained back to the baseline's within the recovery phase "
                        f"({phases['recovery']['seconds']:.0f} s at {phases['recovery']['multiple']:g}x)")
    if "recovered" in summary and "baseline" in phases:
        base, late = phases["baseline"]["bounded"], summary["recovered"]
        # A sign test of their p50: more of them over normal than a median at it would leave, beyond doubt.
        normal, slow = late["normal_s"], late["bounded"]["over_normal"]
        refused, recovery = late["statuses"].get("429", 0), phases["recovery"]
        # Judged, as the baseline's, where the phase's rate is light at the device's speed in the phase
        if recovery["multiple_in_phase"] <= LIGHT * 1.2 and \
                binomial_tail(refused, late["sent"], RECOVERED_REFUSALS, upper=True) < DOUBT:
            problems.append(f"{late['refused_ratio']:.1%} of the requests sent from {late['from_s']:.0f} s, after the "
                            f"backlog had drained, were refused ({refused} of {late['sent']}; "
                            f"{recovery['multiple_in_phase']:.2f}x what the device computed in the phase)")
        if binomial_tail(slow, late["bounded"]["answered"], 0.5, upper=True) < DOUBT:
            problems.append(f"{slow} of {late['bounded']['answered']} one-item scores and completions sent after the "
                            f"backlog had drained took over {normal:.2f} s (normal: the baseline's p50 "
                            f"{base['p50_s']:.2f} s, x1.5 or plus two rounds): p50 {late['bounded']['p50_s']:.2f} s is "
                            f"not back to normal, beyond doubt")
        problems += over_tail(late["bounded"], "after the load dropped", summary)
    bulk = summary["fairness"]["bulk"]
    if bulk["sent"] and not bulk["statuses"].get("200"):
        problems.append(f"the bulk client was never answered ({bulk['statuses']})")
    return problems


def over_tail(bounded: dict[str, Any], when: str, summary: dict[str, Any]) -> list[str]:
    """The problem when more than TAIL of the bounded answers took over the latency bound, beyond doubt: their p99
    is over it."""
    if binomial_tail(bounded["over_bound"], bounded["answered"], TAIL, upper=True) >= DOUBT:
        return []
    return [f"{bounded['over_bound']} of {bounded['answered']} one-item scores and completions answered {when} took "
            f"over SCOREFN_MAX_WAIT_S + one device round (p99 {summary['round_p99_s']:.2f} s) = "
            f"{summary['latency_bound_s']:.2f} s: their p99 is over it (p99 {bounded['p99_s']:.2f} s)"]


def print_summary(summary: dict[str, Any]) -> None:
    rates = summary["rates"]
    print(f"capacity for the mix {summary['calibrated_rate_per_s']:.2f} requests/s (the server's: answered per second "
          f"of device time" + (f"; the calibrating clients' rate {rates['clients']:.2f}/s with the device "
                               f"{rates['device_utilization']:.0%} busy; the service model's "
                               f"{rates['model']:.2f}/s" if "clients" in rates else "; given") +
          f"); SCOREFN_MAX_WAIT_S {summary['max_wait_s']:g} s")
    for phase, p in summary["phases"].items():
        statuses = p["statuses"]
        print(f"{phase:10} {p['seconds']:6.0f} s at {p['rate_per_s']:6.2f}/s ({p['multiple']:g}x; "
              f"{p['multiple_in_phase']:.2f}x the device's speed in the phase): sent {p['sent']:6d}  "
              f"answered {statuses.get('200', 0):6d} ({p['answered_per_s']:.2f}/s)  refused {statuses.get('429', 0):6d}"
              f"  p50 {p['p50_s']:.3f} s  p99 {p['p99_s']:.3f} s  statuses {statuses}")
        b = p["bounded"]
        print(f"    {'(one-item, completions)':24} p50 {b['p50_s']:.3f} s  p99 {b['p99_s']:.3f} s  "
              f"refused {b['refused_ratio']:.1%}  over {summary['latency_bound_s']:.2f} s: {b['over_bound']} of "
              f"{b['answered']}")
        for name, s in p["scenarios"].items():
            print(f"    {name:16} sent {s['sent']:6d}  answered {s['statuses'].get('200', 0):6d} "
                  f"({s['answered_share']:6.1%})  refused {s['statuses'].get('429', 0):6d}  p50 {s['p50_s']:7.3f} s  "
                  f"p99 {s['p99_s']:7.3f} s  queue {s['queue_p50_s']:.3f} s (predicted {s['predicted_queue_p50_s']:.3f})"
                  f"  device {s['device_p50_s']:.3f} s (predicted own {s['predicted_device_p50_s']:.3f})"
                  + (f"  refused by {s['refusals']}" if s.get("refusals") else ""))
    if "overloaded" in summary:
        o = summary["overloaded"]
        print(f"from {o['from_s']:.0f} s (the server said it was overloaded): sent {o['sent']}  answered "
              f"{o['answered_share']:.1%}  statuses {o['statuses']}; by kind: " + ", ".join(
                  f"{name} {s['answered_share']:.1%} of {s['sent']}" for name, s in o["scenarios"].items()))
    if "recovered" in summary:
        r = summary["recovered"]
        print(f"from {r['from_s']:.0f} s (the backlog drained): sent {r['sent']}  p50 {r['p50_s']:.3f} s  p99 "
              f"{r['p99_s']:.3f} s  statuses {r['statuses']}; one-item and completions: {r['bounded']['answered']} "
              f"answered, {r['bounded'].get('over_normal', 0)} over normal")
    if summary["bulk_sizes"]:
        sizes = ", ".join(f"{items}: {own:.2f}" for items, own in summary["bulk_sizes"])
        print(f"bulk requests sized on the idle server (items: own device s): {sizes} (large: from "
              f"{LARGE * summary['max_wait_s']:g} s)")
    f = summary["fairness"]
    beside, alone = f["one_item_beside_bulk"], f["one_item_alone"]
    print(f"fairness: one-item p50/p99 {beside['p50_s']:.3f}/{beside['p99_s']:.3f} s beside a bulk request "
          f"({beside['answered']}), {alone['p50_s']:.3f}/{alone['p99_s']:.3f} s without ({alone['answered']}); "
          f"bulk: {f['bulk']['statuses']}, p50 {f['bulk']['p50_s']:.1f} s")


def run(args: argparse.Namespace, server_env: dict[str, str], query_words: int) -> int:
    reports = args.reports_dir
    print(f"starting scorefn serve ({'small' if args.small_buckets else 'configured'} buckets) ...", flush=True)
    started = time.monotonic()
    server = ServerProcess(env=server_env, log_path=reports / "server.log")
    recovery = plan(args, query_words)["recovery"]
    print(f"ready at {server.url} after {time.monotonic() - started:.1f} s; open loop: calibrate "
          f"{args.calibrate_s:g} s ({args.clients} clients), baseline {args.baseline:g}x for {args.baseline_s:g} s, "
          f"overload {args.open_loop:g}x for {args.duration:g} s, recovery {recovery:g}x for {args.recovery_s:g} s; "
          f"bulk client: from {args.bulk_items} items, doubled until admission judges it large", flush=True)
    try:
        max_wait_s, round_budget_s = server_limits(server.url)
        with RssSampler(server.proc.pid, args.rss_interval) as sampler:
            data = run_locust(server.url, args, query_words, load_settings(server_env).max_items)
    finally:
        exit_code = server.stop()
    summary = summarize(data, max_wait_s, round_budget_s)
    rss = sampler.samples
    summary["rss_mb"] = {"start": rss[0][1], "end": rss[-1][1], "max": max(m for _, m in rss),
                         "second_half_slope_mb_per_min": slope_mb_per_min(rss),
                         "samples": [[round(t, 1), round(m, 1)] for t, m in rss]}
    summary["load_average"] = os.getloadavg()
    print_summary(summary)
    print(f"server RSS MB  start {rss[0][1]:.0f}  end {rss[-1][1]:.0f}  max {summary['rss_mb']['max']:.0f}  "
          f"second-half slope {summary['rss_mb']['second_half_slope_mb_per_min']:+.2f} MB/min; load average "
          + " ".join(f"{x:.2f}" for x in summary["load_average"]))
    problems = verdict(summary, data["records"], args.samples)
    if args.soak and summary["rss_mb"]["second_half_slope_mb_per_min"] > args.max_rss_slope:
        problems.append(f"server RSS grows {summary['rss_mb']['second_half_slope_mb_per_min']:.2f} MB/min over the "
                        f"second half (bound {args.max_rss_slope})")
    if exit_code != 0:
        problems.append(f"the server exited {exit_code} after SIGTERM")
    summary.update(server_exit_code=exit_code, passed=not problems, problems=problems)
    (reports / "openloop_summary.json").write_text(json.dumps(summary, indent=1))
    print(f"reports: {reports}/openloop.html, openloop_summary.json, openloop.json")
    for problem in problems:
        print(f"FAILED: {problem}")
    print("PASSED" if not problems else "FAILED")
    return 1 if problems else 0
