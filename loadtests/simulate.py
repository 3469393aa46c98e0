"""`python -m loadtests.simulate`: admission and device rounds under an open-loop load, in simulated time.

The real scheduler (runtime.requests.scheduler) and the real cost model (runtime.requests.cost.plan_work, on the bucket
plan of the small-bucket test server) run against a simulated device whose rounds take a fixed price per device batch
plus a price per padded token, with log-normal noise (and a CPU's launcher threads: batches run `lanes` at once, in
`overlap` of their serial seconds). Time is simulated: minutes of load take a second, and a run is
decided by the scheduler's logic alone (a seed fixes the arrivals and the noise), so tests judge admission and
fairness here without timing flakes, and the HTTP runs (loadtests/overload.py) check the real server beside it.

The load is loadtests/openloop.py's: Poisson arrivals of the mix (one-item scores 10, 32-item scores 2, 3-document
reranks 2, completions 2) at a multiple of the mix's capacity (requests per second the device computes, each
request alone), and one closed-loop bulk client sending `bulk_items`-item scores back to back (a refused one again after
its Retry-After). Each request's token shapes are those the small-bucket server makes of openloop.py's bodies.

    python -m loadtests.simulate --multiple 4 --bulk-items 1024 --seconds 300
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import math
import random
from typing import Any

from runtime.interface import QueueFull, Sampling
from runtime.shapes.buckets import BucketPlan
from runtime.requests.cost import KINDS, ServiceModel, plan_work
from runtime.shapes.grid import GridLayout
from runtime.requests.jobs import Job, TokenJob
from runtime.requests.scheduler import Scheduler
from runtime.requests.round_builder import ROUND_S

MIX = (("score 1 item", 10), ("score 32 items", 2), ("rerank", 2), ("completions", 2))  # loadtests/openloop.py
BOUNDED = ("score 1 item", "completions")  # small requests: answered within SCOREFN_MAX_WAIT_S plus a round


def small_bucket_plan() -> BucketPlan:
    """The bucket plan of the small-bucket server (runtime.tools.serverproc.SMALL_BUCKETS) on a CPU."""
    return BucketPlan(lengths=(32, 64), max_tokens=16384, labels=(4, 16, 64), context_lengths=(32,),
                      prefix_sharing=True, layout=GridLayout((1, 4, 16), (16,), (8,)), completion_batches=(1, 8))


@dataclasses.dataclass(frozen=True)
class Device:
    """Seconds a round takes: per device batch plus per padded token of each kind (measured on the 2-core development
    CPU with the small buckets: 45 ms a batch, about 800 tokens a second), times log-normal noise."""
    per_batch: float = 0.045
    per_token: tuple[tuple[str, float], ...] = (("full", 1 / 800), ("context", 1 / 800), ("continuation", 1 / 700),
                                                ("completion", 1 / 400))
    noise: float = 0.1  # sigma of the log of a round's time over its price
    lanes: int = 1  # batches run at once (a CPU's launcher threads), in `overlap` of their serial seconds
    overlap: float = 1.0

    @property
    def model(self) -> ServiceModel:
        return ServiceModel(self.per_batch, dict(self.per_token), self.lanes, self.overlap)


def request(kind: str, rng: random.Random) -> Job | TokenJob:
    """A request of this kind, as the small-bucket server tokenizes loadtests/openloop.py's bodies (SmolLM2's
    tokenizer): a one-item score of 11 tokens; 32 items of 47 tokens sharing 46 (longer than the 32-token context
    bucket: scored in full); a rerank of 3 pairs of 56 tokens in the chat template; a completion of 6 tokens; bulk
    items of 6 tokens sharing 5."""
    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, 49152) for _ in range(n)]
    if kind == "score 1 item":
        return Job([tokens(11)], (0, 1))
    if kind == "score 32 items":
        query = tokens(46)
        return Job([query + tokens(1) for _ in range(32)], (0, 1))
    if kind == "rerank":
        query = tokens(30)
        return Job([query + tokens(26) for _ in range(3)], (0, 1))
    if kind == "completions":
        return TokenJob([tokens(6)], [Sampling()])
    if kind.startswith("bulk"):
        query = tokens(5)
        return Job([query + tokens(1) for _ in range(int(kind.split()[1]))], (0, 1))
    raise KeyError(kind)


def capacity(plan: BucketPlan, device: Device) -> float:
    """Requests of the mix per second the device computes, each request alone (its own device batches)."""
    rng = random.Random(0)
    total = sum(weight for _, weight in MIX)
    seconds = sum(weight / total * device.model.seconds(plan_work(plan, [request(kind, rng)])) for kind, weight in MIX)
    return 1 / seconds


def simulate(multiple: float | list[tuple[float, float]], seconds: float = 0.0, bulk_items: int = 256, seed: int = 0,
             max_wait_s: float = 2.0, deadline_s: float = 30.0, plan: BucketPlan | None = None,
             device: Device | None = None, max_round_s: float | None = ROUND_S[0]
             ) -> tuple[list[dict[str, Any]], Scheduler]:
    """Records of every request sent (kind, sent, phase, status 200/429/503, latency of a 200) and the scheduler.
    `multiple` for `seconds`, or phases: [(multiple, seconds), ...] one after another. `max_round_s`: None for auto
    (the seed model's price of a device batch decides)."""
    phases = [(multiple, seconds)] if isinstance(multiple, (int, float)) else list(multiple)
    seconds = sum(length for _, length in phases)
    plan, device = plan or small_bucket_plan(), device or Device()
    rng = random.Random(seed)
    now = [0.0]
    # As calibration might seed it: prices off, the lanes' overlap as measured.
    seed_model = ServiceModel(device.per_batch * 0.7, dict.fromkeys(KINDS, 1 / 700), device.lanes, device.overlap)
    scheduler = Scheduler(seed_model, lambda job: plan_work(plan, [job], marginal=True), 256, max_wait_s, max_round_s,
                          round_cost=lambda jobs: plan_work(plan, jobs), clock=lambda: now[0])
    events: list[tuple[float, int, str, Any]] = []
    counter = [0]

    def at(t: float, what: str, payload: Any) -> None:
        counter[0] += 1
        heapq.heappush(events, (t, counter[0], what, payload))

    names, start, mix_capacity = [name for name, _ in MIX], 0.0, capacity(plan, device)
    for phase, (times, length) in enumerate(phases):
        t = start
        while times > 0 and (t := t + rng.expovariate(times * mix_capacity)) < start + length:
            at(t, "arrive", (rng.choices(names, [weight for _, weight in MIX])[0], phase, None))
        start += length
    if bulk_items:
        at(0.0, "arrive", (f"bulk {bulk_items}", None, None))
    records: list[dict[str, Any]] = []
    busy, busy_s = [False], [0.0]

    def finished(future, record) -> None:
        record["latency"] = now[0] - record["sent"]
        error = future.exception()
        # Admitted, then refused (Retry-After) when it could no longer start in time; anything else failed.
        record["status"] = 200 if error is None else 429 if isinstance(error, QueueFull) else 503
        if record["kind"].startswith("bulk") and now[0] < seconds:
            at(now[0], "arrive", (record["kind"], None, None))  # the bulk client's next request

    def dispatch() -> None:
        while not busy[0] and scheduler.backlog.queue:
            round = scheduler.next_round()
            if round is None:
                return
            took = device.model.seconds(plan_work(plan, [piece.job for piece in round.slices]))
            took *= math.exp(rng.gauss(0.0, device.noise))
            busy[0] = True
            busy_s[0] += took
            at(now[0] + took, "done", round)

    while events:
        now[0], _, what, payload = heapq.heappop(events)
        if what == "arrive":
            kind, phase, job = payload  # job: a refused request sent again, or None for a new one
            record = {"kind": kind, "sent": now[0], "phase": phase}
            records.append(record)
            job = job or request(kind, rng)
            try:
                future = scheduler.admit(job, now[0] + deadline_s, None)
            except QueueFull as refused:
                record.update(status=429, retry_after=refused.retry_after_s, reason=refused.reason)
                if kind.startswith("bulk") and now[0] < seconds:
                    at(now[0] + refused.retry_after_s, "arrive", (kind, phase, job))  # the same request again
            else:
                future.add_done_callback(lambda f, record=record: finished(f, record))
        else:
            scheduler.finish(payload)
            busy[0] = False
            for piece in payload.slices:
                entry = piece.entry
                if not entry.future.done() and entry.add(piece.start, [None] * (piece.stop - piece.start), 0.0):
                    entry.future.set_result(None)
        dispatch()
    scheduler.device_busy_s = busy_s[0]  # the simulated device's seconds of work (its utilization over `seconds`)
    return records, scheduler


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)] if ordered else math.nan


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind: sent, answered, refused, other, the answered share and p50/p99 latency; for the mix: the answered
    share and the smallest answered share of a kind over it (1: every kind answered alike)."""
    kinds: dict[str, Any] = {}
    for kind in sorted({r["kind"] for r in records}):
        mine = [r for r in records if r["kind"] == kind]
        latencies = [r["latency"] for r in mine if r.get("status") == 200]
        kinds[kind] = {"sent": len(mine), "answered": len(latencies),
                       "refused": sum(r.get("status") == 429 for r in mine),
                       "other": sum(r.get("status") not in (200, 429) for r in mine),
                       "answered_share": len(latencies) / len(mine),
                       "p50_s": percentile(latencies, 50), "p99_s": percentile(latencies, 99)}
    mix = [r for r in records if not r["kind"].startswith("bulk")]
    share = sum(r.get("status") == 200 for r in mix) / max(1, len(mix))
    bounded = [r["latency"] for r in mix if r["kind"] in BOUNDED and r.get("status") == 200]
    return {"kinds": kinds, "mix_answered_share": share, "mix_refused": sum(r.get("status") == 429 for r in mix),
            "fairness": min((kinds[name]["answered_share"] for name, _ in MIX if name in kinds), default=share)
            / max(share, 1e-9),
            "bounded_p99_s": percentile(bounded, 99)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.simulate", description=__doc__.split("\n")[0])
    parser.add_argument("--multiple", type=float, default=4.0, help="the mix's rate as a multiple of its capacity")
    parser.add_argument("--seconds", type=float, default=300.0, help="simulated seconds of arrivals")
    parser.add_argument("--bulk-items", type=int, default=1024, help="items of the bulk client's requests (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-wait-s", type=float, default=2.0, help="SCOREFN_MAX_WAIT_S")
    parser.add_argument("--lanes", type=int, default=1, help="device batches run at once")
    parser.add_argument("--overlap", type=float, default=1.0, help="their seconds over the sum of each alone")
    args = parser.parse_args(argv)
    device = Device(lanes=args.lanes, overlap=args.overlap)
    records, scheduler = simulate(args.multiple, args.seconds, args.bulk_items, args.seed, args.max_wait_s,
                                  device=device)
    summary = summarize(records)
    print(f"mix at {args.multiple:g}x its capacity of {capacity(small_bucket_plan(), device):.2f} requests/s for "
          f"{args.seconds:g} simulated s; bulk client: {args.bulk_items} items")
    for kind, s in summary["kinds"].items():
        print(f"  {kind:16} sent {s['sent']:6d}  answered {s['answered']:6d} ({s['answered_share']:5.1%})  refused "
              f"{s['refused']:6d}  other {s['other']:4d}  p50 {s['p50_s']:7.2f} s  p99 {s['p99_s']:7.2f} s")
    print(f"mix answered {summary['mix_answered_share']:.1%}; the least answered kind at {summary['fairness']:.2f} of "
          f"that; one-item and completion p99 {summary['bounded_p99_s']:.2f} s; refusals by reason "
          f"{ {k: v for k, v in scheduler.refused.items() if v} }")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
