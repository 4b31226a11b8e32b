"""Where the routers sent each prefix key lately, and the load that puts on each pod.

Rendezvous hashing alone spreads few keys lumpily: 24 conversations over 3 pods split
13 / 8 / 3 in the run that missed the spread goal (benchmarks/results/routing.md), and a
router that only counts its own requests in flight never saw a pod as busy — each of two
routers has about 4 in flight at 8 concurrent conversations. What a pod will carry is the
conversations that live on it, between their turns as well as during one. So a key is
*placed* on the pod its latest request went to, and while no request of it is in flight here
it keeps a *parked seat* there until `window` seconds after its last request: that pod gets
the conversation's next turn. A pod's load for the routing decision (policy.choose) is this
router's requests in flight to it plus its parked seats — every live conversation counts
once, and a hot prefix with many requests at once counts each of them. A new key is then
placed by bounded load (at most factor x the mean plus slack) instead of by the hash alone;
the spill happens on a conversation's first turn, before any pod holds its prefix.

The router replicas share their placements (router/peers.py pulls each peer's `journal`
and `adopt`s it): a conversation's turns alternate between routers, and a router that placed
a key alone would place a later turn it had not seen by its own counts — elsewhere about
one time in eight (benchmarks/routing_sweep.py). Keys are kept and shared as hashes
(`key_id`), never as request text.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter, OrderedDict, deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from preheat.router.policy import Balance, Choice, choose


def key_id(key: str) -> str:
    """A prefix key as the placements keep and share it: 16 hex digits of its hash."""
    return hashlib.blake2b(key.encode(), digest_size=8).hexdigest()


@dataclass
class _Entry:
    pod: str
    last: float  # its latest request's start, or end once none is in flight here
    in_flight: int = 0


class Placements:
    """Key id -> the pod its latest request went to. A *live* key (a request in flight here,
    or one within `window` seconds) counts on its pod: in flight, or as a parked seat. After
    that it is only *remembered* (`limit` keys, least recently used out): a conversation
    that comes back after a long pause tries its old pod first — its engine may well still
    hold the prefix — but has to pass the bar again. Time is passed in (monotonic seconds),
    so the class is deterministic under test."""

    def __init__(self, window: float, limit: int = 65536) -> None:
        self.window = window
        self.limit = limit
        self._live: OrderedDict[str, _Entry] = OrderedDict()  # least recently touched first
        self._old: OrderedDict[str, _Entry] = OrderedDict()  # remembered, no seat
        self._parked: Counter[str] = Counter()  # pod -> live idle keys placed on it
        # What this router placed, for its peers: (seq, key, pod, when), newest last.
        self._journal: deque[tuple[int, str, str, float]] = deque(maxlen=limit)
        self._seq = itertools.count(1)

    def __len__(self) -> int:
        """Live keys."""
        return len(self._live)

    def placed(self, key: str) -> str | None:
        entry = self._live.get(key) or self._old.get(key)
        return entry.pod if entry is not None else None

    def seated(self, key: str) -> bool:
        """The key holds a parked seat: live, and no request of it in flight here."""
        entry = self._live.get(key)
        return entry is not None and entry.in_flight == 0

    def parked(self, pod: str) -> int:
        return self._parked[pod]

    def load(self, in_flight: Mapping[str, int], key: str | None, now: float) -> dict[str, int]:
        """Each pod of `in_flight` (the Ready pods -> requests in flight to them): those plus
        its parked seats, less the request's own seat (its turn takes that seat up)."""
        self.expire(now)
        mine = self._live[key].pod if key is not None and self.seated(key) else None
        return {p: n + self._parked[p] - (p == mine) for p, n in in_flight.items()}

    def _revive(self, key: str, pod: str, at: float) -> _Entry:
        """The key's live entry, made live if it was not (a new key or a remembered one)."""
        entry = self._live.get(key)
        if entry is None:
            entry = self._old.pop(key, None) or _Entry(pod, at)
            self._live[key] = entry
            self._parked[entry.pod] += 1  # an idle live key holds a seat...
        return entry

    def start(self, key: str, pod: str, now: float) -> None:
        """A request of `key` was sent to `pod`: the key is placed there from now on (that
        pod will hold its freshest prefix)."""
        entry = self._revive(key, pod, now)
        if entry.in_flight == 0:
            self._unpark(entry.pod)  # ...until a request of it is in flight
        entry.pod, entry.last = pod, now
        entry.in_flight += 1
        self._live.move_to_end(key)
        self._journal.append((next(self._seq), key, pod, now))
        self._trim()

    def finish(self, key: str, now: float) -> None:
        """A request of `key` ended (answered, failed or retried elsewhere)."""
        entry = self._live.get(key)
        if entry is None or entry.in_flight == 0:
            return
        entry.in_flight -= 1
        entry.last = now
        if entry.in_flight == 0:
            self._parked[entry.pod] += 1
        self._live.move_to_end(key)

    def adopt(self, key: str, pod: str, at: float) -> bool:
        """A peer router sent a request of `key` to `pod` at `at` (this router's clock):
        place the key there, unless this router has a request of it in flight or sent one
        later. Returns whether it changed anything."""
        known = self._live.get(key) or self._old.get(key)
        if known is not None and (known.in_flight or known.last >= at):
            return False
        entry = self._revive(key, pod, at)
        self._unpark(entry.pod)
        entry.pod, entry.last = pod, at
        self._parked[pod] += 1
        self._live.move_to_end(key)
        self._trim()
        return True

    def journal(self, after: int, now: float) -> tuple[int, bool, list[tuple[str, str, float]]]:
        """What this router placed after sequence number `after`, for a peer: (the latest
        sequence number, whether it is a full listing, [(key, pod, seconds ago)] with one
        row per key). A peer whose `after` fell out of the bounded journal (or is ahead of
        it: this router restarted) gets every live placement instead."""
        first = self._journal[0][0] if self._journal else 1
        latest = self._journal[-1][0] if self._journal else 0
        if after > latest or after < first - 1:
            rows = [(k, e.pod, now - e.last) for k, e in self._live.items()]
            return latest, True, rows
        newest: dict[str, tuple[str, float]] = {}
        for seq, key, pod, when in reversed(self._journal):
            if seq <= after:
                break
            newest.setdefault(key, (pod, now - when))
        return latest, False, [(k, pod, age) for k, (pod, age) in reversed(newest.items())]

    def expire(self, now: float) -> None:
        """Idle keys whose last request is `window` seconds old give up their seat."""
        horizon = now - self.window
        for _ in range(len(self._live)):  # bounded: each step retires a key or passes one by
            key, entry = next(iter(self._live.items()))
            if entry.in_flight:
                self._live.move_to_end(key)  # live: looked at again once it has ended
            elif entry.last > horizon:
                return  # idle keys are (about) in the order of their last request
            else:
                self._retire(key)

    def forget(self, pod: str) -> None:
        """A pod left: its idle keys are placed afresh on their next request."""
        for key in [k for k, e in self._live.items() if e.pod == pod and not e.in_flight]:
            self._retire(key)
        for key in [k for k, e in self._old.items() if e.pod == pod]:
            del self._old[key]
        self._parked.pop(pod, None)

    def _unpark(self, pod: str) -> None:
        self._parked[pod] -= 1
        if self._parked[pod] <= 0:
            del self._parked[pod]

    def _retire(self, key: str) -> None:
        entry = self._live.pop(key)
        self._unpark(entry.pod)
        self._old[key] = entry
        while len(self._old) > self.limit:
            self._old.popitem(last=False)

    def _trim(self) -> None:
        while len(self._live) > self.limit:
            key = next((k for k, e in self._live.items() if not e.in_flight), None)
            if key is None:
                return
            self._retire(key)


@dataclass
class Ledger:
    """What this router has in flight per pod and where the keys are placed: the state that
    policy.choose decides on. The proxy keeps it; benchmarks/routing_sweep.py replays a
    workload through the same object."""

    window: float
    limit: int = 65536
    in_flight: dict[str, int] = field(default_factory=dict)
    placements: Placements = field(init=False)

    def __post_init__(self) -> None:
        self.placements = Placements(self.window, self.limit)

    def choose(self, ready: Collection[str], key: str | None, balance: Balance, now: float,
               exclude: Collection[str] = ()) -> Choice | None:
        kid = key_id(key) if key is not None else None
        in_flight = {p: self.in_flight.get(p, 0) for p in ready}
        load = self.placements.load(in_flight, kid, now)
        if kid is None:
            return choose(load, key, balance, exclude)
        return choose(load, key, balance, exclude, self.placements.placed(kid),
                      self.placements.seated(kid))

    def start(self, pod: str, key: str | None, now: float) -> int:
        self.in_flight[pod] = self.in_flight.get(pod, 0) + 1
        if key is not None:
            self.placements.start(key_id(key), pod, now)
        return self.in_flight[pod]

    def finish(self, pod: str, key: str | None, now: float) -> int:
        self.in_flight[pod] = self.in_flight.get(pod, 0) - 1
        if key is not None:
            self.placements.finish(key_id(key), now)
        return self.in_flight[pod]

    def prune(self, ready: Collection[str]) -> list[str]:
        """Forget the pods that left `ready` and have nothing in flight; returns them."""
        gone = [p for p, n in self.in_flight.items() if p not in ready and not n]
        for pod in gone:
            del self.in_flight[pod]
            self.placements.forget(pod)
        return gone
