"""Sweep the router's balance thresholds (and designs) over a simulated run of
benchmarks/routing.py's workload: the router's own decision code (router/placement.Ledger
-> policy.choose, router/peers.py's journal and merge) in virtual time, hundreds of hash
outcomes per point, in seconds.

A real harness run takes about 15 minutes of two shared cores and is one sample of the
hash: which of 24 conversations land on which of 3 pods. The counts the goals are about —
the cache share of later turns and the spread of requests over pods — depend on that draw
and on the thresholds, hardly on timing, so they are measured here over many draws; the
final numbers in benchmarks/results/routing.md come from the real run.

The model (counts exact, timing coarse): 3 pods with random names; conversations like
routing.py's (a shared prefix of `shared_tokens`, the conversation's own `own_tokens`, then
per turn a question and an answer); `workers` clients, each request a new connection that
the Service stand-in hands to the routers in turn (round robin per connection, as
e2e/service_proxy.py); each router keeps its own Ledger and, when sharing, pulls its peers'
journals every `share_s` seconds (lazily, at its next request). An engine caches what it
was sent: a request finds the longest earlier prompt of its conversation on its pod (the
answer text re-tokenised is not a hit, as measured: 91.7% with every turn on its engine),
else the shared prefix if a conversation of that prefix ran there. Service time: the
machine's cores shared by every request in flight (prefill per uncached token, 32x that per
output token, calibrated on the last run's phase times; +-30% per request), so who is in
flight when is about as in the real run. The model reproduces the last run's two shares
(plain Service 56.0%: model 55%; the earlier router 91.7%: model 92%).

    .venv/bin/python benchmarks/routing_sweep.py              # the tables, markdown
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from preheat.router.peers import EPOCH, journal_body, merge  # noqa: E402
from preheat.router.placement import Ledger, key_id  # noqa: E402
from preheat.router.policy import Balance, choose  # noqa: E402

PREFILL_PER_S = 475.0  # uncached prompt tokens per second, the whole machine
DECODE_COST = 32.0  # one output token costs this many prefill tokens


@dataclass(frozen=True)
class Workload:
    conversations: int = 24
    turns: int = 4
    shared: int = 3  # shared prefixes
    workers: int = 8
    shared_tokens: int = 75  # routing.py's 60 words + "Store policy i:"
    own_tokens: int = 244  # its 200 words + "You help customer ..." and the template
    question_tokens: int = 14
    answer_tokens: int = 17  # max_tokens 12 + the template
    max_tokens: int = 12
    hot: bool = False  # one head for every request, single turn (a few-shot prompt)
    think_s: float = 0.0  # a user's pause before the next turn (exponential, this mean)

    def prompt(self, turn: int) -> int:
        return (self.shared_tokens + self.own_tokens + (turn + 1) * self.question_tokens
                + turn * self.answer_tokens)


@dataclass(frozen=True)
class Design:
    """How the routers decide. window 0 and no sharing: the earlier router (in flight only)."""
    balance: Balance = Balance()
    window: float = 300.0  # --affinity-window
    share_s: float | None = 0.5  # --share-interval; None: routers do not share
    engine_load: bool = False  # in flight as the engines' gauges count it (both routers')
    routers: int = 2
    plain: bool = False  # the plain Service: round robin per connection over the pods


@dataclass
class Outcome:
    share: float  # later-turn prompt tokens from cache (hot: requests finding it cached)
    spread: float  # max pod requests / mean


class _Pod:
    def __init__(self) -> None:
        self.requests = 0
        self.in_flight = 0
        self.shared: set[int] = set()
        self.turns: dict[int, int] = {}  # conversation -> latest turn it ran here


def simulate(w: Workload, d: Design, seed: int, pods: int = 3) -> Outcome:
    rng = random.Random(seed)
    names = [f"chat-{rng.randrange(16 ** 6):06x}" for _ in range(pods)]
    state = {n: _Pod() for n in names}
    ledgers = [Ledger(d.window) for _ in range(d.routers)]
    cursors = {(i, j): (EPOCH + "-not-yet", 0) for i in range(d.routers) for j in range(d.routers)}
    pulled = [-rng.random() * (d.share_s or 0) for _ in ledgers]
    conn = itertools.count(rng.randrange(d.routers * pods))
    tag = rng.randrange(1 << 30)
    convs = iter(range(w.conversations))
    in_flight: list[list] = []  # [work left, worker, conversation, turn, pod, key, router]
    pausing: list[tuple[float, int, int, int]] = []  # (until, worker, conversation, turn)
    now = 0.0
    later_prompt = later_cached = 0

    def pull(i: int) -> None:
        if d.share_s is None or now - pulled[i] < d.share_s:
            return
        pulled[i] = now
        for j, peer in enumerate(ledgers):
            if j != i:
                epoch, seq = cursors[i, j]
                body = journal_body(peer.placements, seq, epoch, now)
                merge(ledgers[i].placements, body, now)
                cursors[i, j] = (body["epoch"], body["seq"])

    def route(i: int, key: str) -> str:
        ledger = ledgers[i]
        if not d.engine_load:
            return ledger.choose(names, key, d.balance, now).pod
        kid = key_id(key)
        load = ledger.placements.load({n: state[n].in_flight for n in names}, kid, now)
        return choose(load, key, d.balance, (), ledger.placements.placed(kid),
                      ledger.placements.seated(kid)).pod

    def send(worker: int, c: int, turn: int) -> None:
        nonlocal later_prompt, later_cached
        n = next(conn)
        key = f"{tag}-hot" if w.hot else f"{tag}-conversation-{c}"
        if d.plain:
            pod, r = names[n % pods], None
        else:
            r = n % d.routers
            pull(r)
            pod = route(r, key)
            ledgers[r].start(pod, key, now)
        p = state[pod]
        if w.hot:
            hit = w.prompt(0) if p.requests else 0
            later_prompt += w.prompt(0)
            later_cached += hit
        else:
            if c in p.turns:
                hit = w.prompt(min(p.turns[c], turn - 1)) if turn else w.shared_tokens + w.own_tokens
            else:
                hit = w.shared_tokens if c % w.shared in p.shared else 0
            if turn > 0:
                later_prompt += w.prompt(turn)
                later_cached += hit
        p.requests += 1
        p.in_flight += 1
        p.shared.add(c % w.shared)
        p.turns[c] = max(p.turns.get(c, -1), turn)
        # +-30%: the engines' steps, the other work on the machine; it varies who overlaps.
        work = ((w.prompt(turn) - hit) + DECODE_COST * w.max_tokens) * rng.uniform(0.7, 1.3)
        in_flight.append([work, worker, c, turn, pod, key, r])

    def next_conversation(worker: int) -> None:
        c = next(convs, None)
        if c is not None:
            send(worker, c, 0)

    for worker in range(w.workers):
        next_conversation(worker)
    while in_flight or pausing:
        # Processor sharing: every request in flight advances at PREFILL_PER_S / n.
        rate = PREFILL_PER_S / max(1, len(in_flight))
        first = min(in_flight, key=lambda q: q[0]) if in_flight else None
        done = now + first[0] / rate if first else float("inf")
        if pausing and pausing[0][0] < done:  # a user's pause ends first
            until, worker, c, turn = pausing.pop(0)
            for q in in_flight:
                q[0] -= rate * (until - now)
            now = until
            send(worker, c, turn)
            continue
        for q in in_flight:
            q[0] -= rate * (done - now)
        now = done
        in_flight.remove(first)
        _, worker, c, turn, pod, key, r = first
        state[pod].in_flight -= 1
        if r is not None:
            ledgers[r].finish(pod, key, now)
        if turn + 1 < (1 if w.hot else w.turns):
            if w.think_s:
                pausing.append((now + rng.expovariate(1 / w.think_s), worker, c, turn + 1))
                pausing.sort()
            else:
                send(worker, c, turn + 1)
        else:
            next_conversation(worker)
    reqs = [state[n].requests for n in names]
    return Outcome(later_cached / later_prompt, max(reqs) / (sum(reqs) / pods))


@dataclass
class Point:
    label: str
    share_mean: float
    share_p10: float
    share_min: float
    spread_mean: float
    spread_p90: float
    spread_max: float
    over: float  # share of draws with a pod above 1.5x the mean


def sweep_point(w: Workload, d: Design, seeds: int, label: str) -> Point:
    out = [simulate(w, d, s) for s in range(seeds)]
    shares = sorted(o.share for o in out)
    spreads = sorted(o.spread for o in out)
    return Point(label, statistics.fmean(shares), shares[len(shares) // 10], shares[0],
                 statistics.fmean(spreads), spreads[(len(spreads) * 9) // 10], spreads[-1],
                 sum(s > 1.5 + 1e-9 for s in spreads) / len(spreads))


def table(points: list[Point], share_name: str) -> str:
    lines = [f"| | {share_name}: mean / p10 / min | max pod requests / mean: mean / p90 / max "
             "| draws with a pod above 1.5x |", "|---|---:|---:|---:|"]
    for p in points:
        lines.append(f"| {p.label} | {p.share_mean:.1%} / {p.share_p10:.1%} / {p.share_min:.1%} "
                     f"| {p.spread_mean:.2f} / {p.spread_p90:.2f} / {p.spread_max:.2f} "
                     f"| {p.over:.1%} |")
    return "\n".join(lines)


GRID = [(1.0, 0), (1.0, 1), (1.1, 1), (1.25, 0), (1.25, 1), (1.5, 0), (1.5, 1), (1.5, 2),
        (2.0, 1), (3.0, 0)]
SHARE = "later-turn prompt tokens from cache"


def trade_off(w: Workload, grid: list[tuple[float, int]], seeds: int) -> str:
    """Each threshold pair on the workloads where they differ: the benchmark's (spread),
    a hot prefix (spread), users pausing longer than --affinity-window (cache share: a
    returning conversation has to pass the bar again), and 5x the scale."""
    hot = replace(w, hot=True, conversations=w.conversations * w.turns)
    paused = replace(w, think_s=600.0)
    big = replace(w, conversations=w.conversations * 5, workers=w.workers * 5)
    lines = ["| bar | benchmark: spread p90 / max, draws above 1.5x | hot prefix: spread max "
             "| pauses of 600 s (mean): cache share | 5x scale: spread max "
             "| 5x scale, pauses of 600 s: cache share |", "|---|---:|---:|---:|---:|---:|"]
    for f, s in grid:
        d = Design(balance=Balance(f, s))
        a = sweep_point(w, d, seeds, "")
        h = sweep_point(hot, d, max(10, seeds // 3), "")
        t = sweep_point(paused, d, max(10, seeds // 2), "")
        b = sweep_point(big, d, max(5, seeds // 8), "")
        bt = sweep_point(replace(big, think_s=600.0), d, max(5, seeds // 8), "")
        lines.append(f"| {f:g} / {s} | {a.spread_p90:.2f} / {a.spread_max:.2f}, {a.over:.1%} "
                     f"| {h.spread_max:.2f} | {t.share_mean:.1%} | {b.spread_max:.2f} "
                     f"| {bt.share_mean:.1%} |")
    return "\n".join(lines)


def main(a: argparse.Namespace) -> None:
    w = Workload(conversations=a.conversations, workers=a.workers)
    grid = [(float(f), int(s)) for f, s in (g.split("/") for g in a.grid)] if a.grid else GRID
    chosen = Balance(a.chosen[0], int(a.chosen[1]))
    say: Callable[[str], None] = lambda s: print(s, flush=True)  # noqa: E731
    say(f"{a.seeds} hash draws per row; {w.conversations} conversations x {w.turns} turns, "
        f"{w.workers} at a time, 2 routers, 3 pods (as benchmarks/routing.py).\n")
    say("### The designs (`--balance-factor` / `--balance-slack`)\n")
    rows = [sweep_point(w, Design(plain=True), a.seeds, "plain Service")]
    earlier = Design(window=0.0, share_s=None)
    rows += [sweep_point(w, replace(earlier, balance=Balance(f, s)), a.seeds,
                         f"requests in flight, each router its own: {f:g} / {s}")
             for f, s in ((1.5, 2), (1.25, 0))]
    rows += [sweep_point(w, replace(earlier, engine_load=True, balance=Balance(f, s)), a.seeds,
                         f"requests in flight, as the engines' gauges count them: {f:g} / {s}")
             for f, s in ((1.5, 2), (1.5, 0), (1.25, 1), (1.25, 0))]
    rows += [sweep_point(w, Design(balance=Balance(f, s), share_s=None), a.seeds,
                         f"conversations placed, each router its own: {f:g} / {s}")
             for f, s in ((1.25, 1), (1.5, 1))]
    rows += [sweep_point(w, Design(balance=Balance(f, s)), a.seeds,
                         f"conversations placed, shared between routers: {f:g} / {s}")
             for f, s in grid]
    say(table(rows, SHARE))
    say("\n### The thresholds where they differ\n")
    say(trade_off(w, grid, a.seeds))
    say(f"\n### Around {chosen.factor:g} / {chosen.slack}: the other settings\n")
    d = Design(balance=chosen)
    rows = [sweep_point(w, replace(d, window=win), a.seeds, f"--affinity-window {win:g} s")
            for win in (20.0, 60.0, 300.0)]
    rows += [sweep_point(w, replace(d, share_s=s), a.seeds, f"--share-interval {s:g} s")
             for s in (0.5, 2.0, 5.0)]
    rows += [sweep_point(w, replace(d, routers=r), a.seeds, f"{r} router(s)") for r in (1, 3)]
    rows += [sweep_point(replace(w, conversations=c), d, a.seeds, f"{c} conversations")
             for c in (12, 48)]
    rows += [sweep_point(replace(w, workers=k), d, a.seeds, f"{k} at a time") for k in (4, 16)]
    say(table(rows, SHARE))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=300, help="hash draws per row")
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--grid", nargs="*", help="factor/slack pairs (default: a grid)")
    p.add_argument("--chosen", nargs=2, type=float, default=(Balance().factor, Balance().slack),
                   metavar=("FACTOR", "SLACK"), help="the point to vary the rest around")
    main(p.parse_args())
