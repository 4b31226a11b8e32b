"""Built-in autoscaling under load, warm pool vs. cold, in one run on the local harness.

Per trial an InferenceService of the embedded model with `autoscaling.metric.type: Engine`
(preheat_num_requests_running, target 4 per pod, max 2 replicas) is applied on the e2e local
cluster (API emulator + real operator + local kubelet, docs/e2e.md); many concurrent
streaming `openai` clients load its one serving pod through the Service (the harness's
stand-in, e2e/service_proxy.py); the clock runs from the first request to the second Ready serving pod, and
from the end of the last request to the service being back at minReplicas (1). Warm trials
(`warmPool.size: 1`, the second pod is promoted) and cold trials (`warmPool.size: 0`, the
operator creates it) alternate.

    .venv/bin/python benchmarks/autoscale.py        # -> benchmarks/results/autoscale.md
    .venv/bin/python benchmarks/autoscale.py --record tests/operator/fixtures/autoscale/run.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from e2e import autoscale_scenario, scenario  # noqa: E402
from e2e.autoscale_scenario import Outcome  # noqa: E402
from e2e.local_cluster import LocalCluster, local_cluster  # noqa: E402
from e2e.waiting import eventually  # noqa: E402

INCOMPLETE: list[tuple[str, str]] = []  # (trial, why) for trials that did not finish
LOADAVG: list[float] = []  # the machine's 1-minute load average, sampled at each trial's end


async def trial(c: LocalCluster, service: str, warm_pool: int,
                a: argparse.Namespace) -> Outcome | None:
    out = None
    try:
        out = await autoscale_scenario.scale_on_load(
            c, service, warm_pool=warm_pool, clients=a.clients, max_replicas=2,
            down_window_s=a.down_window, hold_s=a.hold, max_tokens=a.max_tokens,
            require_no_failures=False, readiness_failure_threshold=a.failure_threshold)
        print(f"{service}: {json.dumps(out.timings.values)} requests {out.load.sent} "
              f"failed {out.load.failed} promoted {out.promoted}", flush=True)
    except AssertionError as e:  # a step's wait ran out: reported, not hidden
        INCOMPLETE.append((service, str(e)[:300]))
        print(f"{service}: INCOMPLETE: {e}", flush=True)
    LOADAVG.append(os.getloadavg()[0])
    await scenario.delete_everything(c, service, scenario.Timings())

    async def quiet():  # no engine left running (or draining) before the next trial
        return not c.kubelet.pods and not c.kubelet.live_pids()
    await eventually(quiet, 60, interval=0.1)
    return out


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _row(mode: str, outs: list[Outcome], key: str) -> str:
    xs = [o.timings.values[key] for o in outs]
    return (f"| {mode} | {len(xs)} | {statistics.median(xs):.2f} | {min(xs):.2f} | "
            f"{max(xs):.2f} | {', '.join(f'{x:.2f}' for x in xs)} |")


def _failures(outs: list[Outcome]) -> str:
    kinds: dict[str, int] = {}
    for o in outs:
        for e in o.load.errors:
            kind = e[:80]
            kinds[kind] = kinds.get(kind, 0) + 1
    return "; ".join(f"{n} × {k}" for k, n in sorted(kinds.items(), key=lambda x: -x[1])) or "none"


def _ttft(outs: list[Outcome], after: bool) -> list[float]:
    return [ttft for o in outs for sent, ttft in o.load.ttft
            if (sent >= o.second_ready_at) == after]


def _per_trial(names: list[str], outs: list[Outcome]) -> str:
    rows = ["| trial | ScaleUp in status (s) | 2nd Ready serving (s) | NoMetrics episodes "
            "after load start | load end → min (s) | requests sent / failed |",
            "| --- | --- | --- | --- | --- | --- |"]
    for name, o in zip(names, outs):
        up = next((st["seen_s"] for st in o.statuses if st["reason"] == "ScaleUp"), None)
        blind = sum(1 for st in o.statuses if st["reason"] == "NoMetrics")
        rows.append(f"| {name} | {'-' if up is None else f'{up:.1f}'} | "
                    f"{o.timings.values['load_start_to_second_ready_s']:.1f} | {blind} | "
                    f"{o.timings.values['load_end_to_min_s']:.1f} | "
                    f"{o.load.sent} / {o.load.failed} |")
    return "\n".join(rows)


def _trail(o: Outcome) -> str:
    rows = ["| s after load start | reason | average running | desired |",
            "| --- | --- | --- | --- |"]
    for st in o.statuses:
        avg = st.get("currentAverageValue")
        rows.append(f"| {st['seen_s']:.1f} | {st['reason']} | "
                    f"{'-' if avg is None else f'{avg:g}'} | {st['desiredReplicas']} |")
    return "\n".join(rows)


def report(warm: list[Outcome], cold: list[Outcome], a: argparse.Namespace) -> str:
    everything = warm + cold
    sent = sum(o.load.sent for o in everything)
    failed = sum(o.load.failed for o in everything)
    up_ratio = (statistics.median(o.timings.values["load_start_to_second_ready_s"] for o in cold)
                / statistics.median(o.timings.values["load_start_to_second_ready_s"] for o in warm))
    cpu = platform.processor() or platform.machine()
    return f"""# Autoscaling on engine load: warm pool vs. cold

The built-in autoscaler (`autoscaling.metric.type: Engine`, `preheat_num_requests_running`,
`targetAverageValue: 4`, `minReplicas: 1`, `maxReplicas: 2`,
`scaleUpStabilizationSeconds: 0`, `scaleDownStabilizationSeconds: {a.down_window}`) under
{a.clients} concurrent streaming `openai` SDK clients (each sends back to back,
`max_tokens: {a.max_tokens}`, no retries) against an engine allowed 8 running sequences.
Measured in one run of `benchmarks/autoscale.py` on the local harness (docs/e2e.md): the
API emulator, the real operator (`preheat operator --autoscale-interval {a.interval}`, a
subprocess), real `preheat serve` engines with the embedded SmolLM2-135M model, and the
clients in a process of their own (e2e/load_clients.py) sending through the harness's
Service stand-in (e2e/service_proxy.py: Ready serving pods only, one connection per
request, round robin).
Warm and cold trials alternate. Readiness probe: every 1 s, 1 s timeout, failure threshold
{a.failure_threshold or "3 (the default)"}.

**load start → second Ready serving pod** (first request sent → the second serving pod's
`Ready` condition is `True`):

| mode | trials | median s | min s | max s | each s |
| --- | --- | --- | --- | --- | --- |
{_row("warm pool (`warmPool.size: 1`): promotion", warm, "load_start_to_second_ready_s")}
{_row("cold (`warmPool.size: 0`): a new pod", cold, "load_start_to_second_ready_s")}

**load end → back to min** (the last request finished → `spec.replicas` 1 and one serving
pod left; the {a.down_window} s scale-down window is most of it):

| mode | trials | median s | min s | max s | each s |
| --- | --- | --- | --- | --- | --- |
{_row("warm pool", warm, "load_end_to_min_s")}
{_row("cold", cold, "load_end_to_min_s")}

Scale-up under load is **{up_ratio:.1f}× faster warm than cold**. Requests: {sent} sent,
**{failed} failed** (every request counted; the clients do not retry) — warm trials
{sum(o.load.sent for o in warm)} sent / {sum(o.load.failed for o in warm)} failed
({_failures(warm)}), cold trials {sum(o.load.sent for o in cold)} sent /
{sum(o.load.failed for o in cold)} failed ({_failures(cold)}). Every warm trial's second
serving pod was the former warm pod: {all(o.promoted for o in warm)}.

Per trial — when `status.autoscaling` first showed the ScaleUp decision and when the second
serving pod was Ready (both seconds after load start), how many times the status turned to
`NoMetrics` after load start (no Ready serving pod answered: an overloaded engine failing its
readiness probe is not asked, and then nothing can be decided), and the requests:

{_per_trial([f"warm {i}" for i in range(len(warm))], warm)}
{chr(10).join(_per_trial([f"cold {i}" for i in range(len(cold))], cold).splitlines()[2:])}

A failed request "no Ready serving pod" is a client that found the Service without
endpoints; it tries again every 0.2 s, and each try counts.

Time to first token while the one pod was overloaded vs. once the second serving pod was
Ready (all trials of a mode, p50 / p99 s):

| mode | before: p50 | before: p99 | after: p50 | after: p99 |
| --- | --- | --- | --- | --- |
| warm pool | {_pct(_ttft(warm, False), .5):.2f} | {_pct(_ttft(warm, False), .99):.2f} | {_pct(_ttft(warm, True), .5):.2f} | {_pct(_ttft(warm, True), .99):.2f} |
| cold | {_pct(_ttft(cold, False), .5):.2f} | {_pct(_ttft(cold, False), .99):.2f} | {_pct(_ttft(cold, True), .5):.2f} | {_pct(_ttft(cold, True), .99):.2f} |

What the numbers are made of:

- **load start → second Ready (warm)**: the running gauge reaches 8 on the one pod; the
  next autoscaler pass (every {a.interval} s here; 15 s by default, like the HPA) reads it
  from `/metrics`, recommends ceil(8 / 4 × 1) = 2 and PATCHes `/scale`; the reconciler
  relabels the ready warm pod `role=serving`, which is `Ready` at once. The pool is refilled
  with a new pod afterwards, out of the users' path.
- **cold**: the same decision, then the operator creates a pod and the engine starts and
  warms up on a machine whose two cores are busy serving the load.
- **load end → min**: the recommendation drops to 1 with the gauges; the scale-down window
  keeps 2 until {a.down_window} s after the last recommendation of 2; then the next pass
  sets 1 and the reconciler deletes (or demotes into the pool) one serving pod.
- Load in this run also includes this script and the operator: all on one 2-core machine,
  so absolute numbers are CPU-bound; compare the modes side by side. The machine's 1-minute
  load average at the end of each trial: {", ".join(f"{x:.1f}" for x in LOADAVG)} (other
  work shared it; above 2 the engines, the operator and the harness wait for a core).

The decisions of the first warm trial, as `status.autoscaling` showed them:

{_trail(warm[0])}

Machine: {os.cpu_count()} CPU cores ({cpu}), Python {platform.python_version()}, no GPU used;
commit {_commit()}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC,
{a.trials} trials per mode, hold {a.hold} s of load after the scale-up. {_incomplete()}
"""


def _incomplete() -> str:
    if not INCOMPLETE:
        return "Every trial completed."
    return "Trials that did not complete (left out of the tables above): " + "; ".join(
        f"{name}: {why}" for name, why in INCOMPLETE) + "."


def write_recording(log: Path, service: str, out: Path) -> None:
    """The operator's own decision log for one service, as a replayable fixture."""
    rounds = [json.loads(line) for line in log.read_text().splitlines()]
    mine = [r for r in rounds if r["service"].endswith("/" + service)]
    assert mine and mine[0]["fresh"], "the recording must start at the autoscaler's first pass"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "what": "every pass of the built-in autoscaler for one service on the local harness "
                "(benchmarks/autoscale.py --record): per pass the time, spec.replicas, the "
                "serving pods' samples, and the decision",
        "policy": mine[0]["policy"],
        "rounds": [{k: r[k] for k in ("t", "current", "samples", "desired", "reason")}
                   for r in mine],
    }, indent=1) + "\n")


async def main(a: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="preheat-autoscale-") as tmp:
        log = Path(tmp) / "autoscale.jsonl"
        args = ("--autoscale-interval", str(a.interval), "--metrics-timeout", "1",
                "--autoscale-log", str(log))
        warm: list[Outcome] = []
        cold: list[Outcome] = []
        async with local_cluster(Path(tmp) / "node", operator_args=args) as c:
            try:
                for i in range(a.trials):
                    for mode, pool, outs in (("warm", 1, warm), ("cold", 0, cold)):
                        out = await trial(c, f"bench-{mode}-{i}", pool, a)
                        if out is not None:
                            outs.append(out)
            except BaseException:
                print(c.diagnostics(), file=sys.stderr)
                raise
        if a.record:
            write_recording(log, "bench-warm-0", a.record)
    a.out.write_text(report(warm, cold, a))
    print(a.out.read_text())


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--clients", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--hold", type=float, default=8.0, help="seconds of load after the scale-up")
    p.add_argument("--down-window", type=int, default=20,
                   help="scaleDownStabilizationSeconds (300 by default in a real spec)")
    p.add_argument("--interval", type=float, default=1.0, help="operator --autoscale-interval")
    p.add_argument("--failure-threshold", type=int, default=None,
                   help="readiness.failureThreshold of the service (default: the CRD's 3); on a "
                        "shared, overloaded machine idle engines can miss 1-s probes")
    p.add_argument("--record", type=Path, help="write the first warm trial's passes here")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "autoscale.md")
    asyncio.run(main(p.parse_args()))
