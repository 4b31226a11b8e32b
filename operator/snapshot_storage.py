"""Is `spec.snapshot.size` big enough for the snapshots the engines will keep? A pure check.

An engine keeps the newest KEEP snapshots of its model (engine/kv/snapshot.py DEFAULT_KEEP)
and needs room for one more being written and one fetched from a peer, each up to max
tokens of KV — `--snapshot-max-tokens`, or the KV pool's size when that is smaller (a
snapshot holds what the pool caches):

    needed = KV bytes per token x max tokens x (KEEP + 2)

What lands beside them counts too. On a shared claim (snapshot.storage SharedVolume) with
`snapshot.cacheWeights` the engines keep their converted weights there
(PREHEAT_WEIGHT_CACHE_DIR, render.weight_cache_dir); downloads never do (they have a volume
of their own, spec.model.cache). A pod-local emptyDir holds only snapshots, and its
sizeLimit is `snapshot.size`: exceeding it evicts the pod.

The operator cannot know a model's bytes per token by itself: the engine publishes them on
/metrics once the model is loaded (engine_facts.py reads them), and until one has, the
condition is Unknown. Too small is reported, not refused: the engine then prunes harder and
keeps fewer snapshots (it says so in its log).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from preheat.operator.quantity import parse_quantity

CONDITION = "SnapshotStorageSufficient"
KEEP = 3  # engine/kv/snapshot.py DEFAULT_KEEP (tests/warmstart/test_snapshot_size_gauges.py)
SPARE = 2  # one snapshot being written, one fetched from a peer

# The engine's gauges (engine/metrics.py) this check reads.
BYTES_PER_TOKEN = "preheat_kv_cache_bytes_per_token"
MAX_TOKENS = "preheat_snapshot_max_tokens"
POOL_TOKENS = "preheat_kv_cache_capacity_tokens"  # a snapshot is at most the KV pool
WEIGHT_CACHE_BYTES = "preheat_model_weight_cache_bytes"


@dataclass(frozen=True)
class EngineFacts:
    """What an engine of the current pod template published: the same for all of them."""
    kv_bytes_per_token: int
    max_tokens: int  # tokens one snapshot holds at most: min(--snapshot-max-tokens, the pool)
    weight_cache_bytes: int = 0

    def as_status(self, template_hash: str) -> dict[str, Any]:
        return {"templateHash": template_hash, "kvBytesPerToken": self.kv_bytes_per_token,
                "maxTokens": self.max_tokens, "weightCacheBytes": self.weight_cache_bytes}

    @classmethod
    def from_status(cls, entry: Any, template_hash: str) -> EngineFacts | None:
        """The facts status.snapshotStorage recorded for this template (None: another
        template's, or none): read once per template, not on every pass."""
        if not isinstance(entry, dict) or entry.get("templateHash") != template_hash:
            return None
        try:
            return cls(int(entry["kvBytesPerToken"]), int(entry["maxTokens"]),
                       int(entry.get("weightCacheBytes") or 0))
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True)
class StorageCheck:
    """The inputs: the spec's snapshot section and what an engine published (None: no
    engine of the current template has yet)."""
    enabled: bool
    shared: bool
    size: str  # spec.snapshot.size, a quantity
    cache_weights: bool  # spec.snapshot.cacheWeights: converted weights on a shared claim
    facts: EngineFacts | None = None
    keep: int = KEEP


@dataclass(frozen=True)
class Verdict:
    status: str  # "True", "False" or "Unknown"
    reason: str
    message: str
    needed_bytes: int | None = None  # snapshots plus what shares the volume
    size_bytes: int | None = None

    def condition(self) -> dict[str, Any]:
        return {"type": CONDITION, "status": self.status, "reason": self.reason,
                "message": self.message}


def snapshot_bytes(facts: EngineFacts, keep: int = KEEP) -> int:
    """What the snapshots alone need: bytes per token x max tokens x (keep + 2)."""
    return facts.kv_bytes_per_token * facts.max_tokens * (keep + SPARE)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _at_least(n: int) -> str:
    """A quantity of at least n bytes to paste into snapshot.size."""
    return f"{-(-n // 2**30)}Gi" if n >= 2**30 else f"{-(-n // 2**20)}Mi"


def check(c: StorageCheck) -> Verdict:
    if not c.enabled:
        return Verdict("True", "SnapshotsDisabled", "snapshots are disabled")
    try:
        size = int(parse_quantity(c.size))
    except ValueError:
        return Verdict("False", "InvalidSize", f"snapshot.size {c.size!r} is not a quantity")
    if c.facts is None:
        return Verdict("Unknown", "NotReported", "no engine of the current template has "
                       "published its KV bytes per token yet (preheat_kv_cache_bytes_per_token)",
                       size_bytes=size)
    f = c.facts
    snaps = snapshot_bytes(f, c.keep)
    weights = f.weight_cache_bytes if c.shared and c.cache_weights else 0
    needed = snaps + weights
    where = "The shared claim" if c.shared else "each pod's emptyDir (its sizeLimit)"
    parts = [f"{f.kv_bytes_per_token} bytes per token x {f.max_tokens} tokens per snapshot x "
             f"({c.keep} kept + 1 being written + 1 fetched) = {snaps} bytes ({_gib(snaps)}) "
             f"of snapshots"]
    if weights:
        parts.append(f"{weights} bytes ({_gib(weights)}) of converted weights "
                     "(snapshot.cacheWeights)")
    shares = " + ".join(parts)
    if c.shared:
        shares += "; downloads have their own volume (model.cache)"
    if needed <= size:
        return Verdict("True", "Sufficient", f"{where} of {c.size} ({size} bytes) holds {shares}",
                       needed, size)
    return Verdict("False", "SnapshotStorageTooSmall",
                   f"{where} of {c.size} ({size} bytes) is below the {needed} bytes "
                   f"({_gib(needed)}) needed: {shares}. Raise snapshot.size to at least "
                   f"{_at_least(needed)}, or lower the engines' --snapshot-max-tokens; until then "
                   "they prune harder and keep fewer snapshots", needed, size)
