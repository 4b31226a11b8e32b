"""Built-in autoscaling end to end on the local harness (issue 19): the real operator reads
engine load from real engines' /metrics, scales up by promoting the warm pod while many
streaming openai clients keep it busy, and back down after the scale-down window; no
request fails. Timings are printed, not asserted (benchmarks/autoscale.py measures them)."""

from __future__ import annotations

import json

import pytest

from e2e import autoscale_scenario
from e2e.local_cluster import local_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SERVICE = "busy"


async def test_engine_load_scales_up_by_promotion_and_back_down_with_no_failed_request(tmp_path):
    log = tmp_path / "autoscale.jsonl"
    args = ("--autoscale-interval", "1", "--metrics-timeout", "1", "--autoscale-log", str(log))
    async with local_cluster(tmp_path / "node", operator_args=args) as cluster:
        outcome = None
        try:
            outcome = await autoscale_scenario.scale_on_load(
                cluster, SERVICE, warm_pool=1, clients=12, max_replicas=2, down_window_s=5,
                hold_s=3, max_tokens=16)
            assert outcome.promoted, "the second serving pod must be the former warm pod"
            # Under sustained load the count stays at 2: no flapping.
            assert set(outcome.replicas_seen) == {2}, outcome.replicas_seen
            # Both serving pods took traffic once the second one was Ready.
            assert len(outcome.by_pod) == 2, outcome.by_pod
            sizes = [m.split(";")[0] for _, m in outcome.rescales]
            assert sizes == ["New size: 2", "New size: 1"], outcome.rescales
            reasons = [s["reason"] for s in outcome.statuses]
            assert "ScaleUp" in reasons and "ScaleDown" in reasons, outcome.statuses
            # What the operator saw is in its decision log: serving pods only, one record a pass.
            rounds = [json.loads(line) for line in log.read_text().splitlines()]
            assert rounds and all(r["service"] == f"default/{SERVICE}" for r in rounds)
            assert max(len(r["samples"]) for r in rounds) == 2
        except BaseException:
            print(cluster.diagnostics())
            raise
        finally:
            if outcome is not None:
                print("autoscale timings:", json.dumps(outcome.timings.values, indent=1))
                print("requests:", outcome.load.sent, "failed:", outcome.load.failed,
                      "by pod:", outcome.by_pod)
                print("decisions:", json.dumps(outcome.statuses, indent=1))
