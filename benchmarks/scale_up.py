"""Scale-up latency with a warm pool vs. without, measured in one run on the local harness.

For each mode an InferenceService of the embedded model (replicas 1) is applied on the e2e
local cluster (API emulator + real operator + local kubelet, see docs/e2e.md); then, per
trial, replicas goes 1 -> 2 through the /scale subresource and the clock runs until the
second serving pod's Ready condition is True (readiness gate included), then back to 1.

    .venv/bin/python benchmarks/scale_up.py            # -> benchmarks/results/scale_up.md
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from e2e import scenario  # noqa: E402
from e2e.local_cluster import LocalCluster, local_cluster  # noqa: E402
from e2e.waiting import eventually  # noqa: E402
from preheat.operator.resources import INFERENCE_SERVICES  # noqa: E402

READY_IN = re.compile(r"ready in ([0-9.]+)s")


async def settle(c: LocalCluster, service: str, warm_pool: int) -> None:
    """Back to 1 serving + the full pool, and no process still draining (quiet CPU)."""
    async def settled():
        st = await scenario.status_of(c, service)
        ready = await scenario.ready_by_role(c, service)
        return (st.get("phase") == "Ready" and len(ready["serving"]) == 1
                and len(ready["warm"]) == warm_pool
                and len(c.kubelet.live_pids()) == 1 + warm_pool)
    await eventually(settled, scenario.START_TIMEOUT_S, interval=0.1)


async def measure(c: LocalCluster, service: str, warm_pool: int, trials: int) -> list[float]:
    await scenario.apply(c, service, warm_pool=warm_pool, t=scenario.Timings())
    await settle(c, service, warm_pool)
    out = []
    for _ in range(trials):
        t = scenario.Timings()
        await scenario.scale_up_by_promotion(c, service, t, target_s=None)
        out.append(t.values["scale_up_second_ready_s"])
        print(f"{service}: 1 -> 2 serving Ready in {out[-1]:.3f} s", flush=True)
        await c.kube.patch(INFERENCE_SERVICES, c.namespace, service,
                           {"spec": {"replicas": 1}}, subresource="scale")
        await settle(c, service, warm_pool)
    await scenario.delete_everything(c, service, scenario.Timings())
    await eventually(lambda: _none_running(c), 60, interval=0.1)
    return out


async def _none_running(c: LocalCluster) -> bool:
    return not c.kubelet.pods and not c.kubelet.live_pids()


def engine_ready_times(c: LocalCluster, prefix: str) -> list[float]:
    """The engine's own start-to-ready time, from each `<prefix>` pod's first log."""
    out = []
    for rt in c.kubelet.finished:
        if rt.name.startswith(prefix) and rt.logs and rt.logs[0].exists():
            m = READY_IN.search(rt.logs[0].read_text(errors="replace"))
            if m:
                out.append(float(m.group(1)))
    return out


def missed_first_startup_probe(c: LocalCluster, prefix: str) -> tuple[int, int]:
    """(pods whose first startup probe came before the server listened, pods)."""
    pods = [rt for rt in c.kubelet.finished if rt.name.startswith(prefix) and rt.probes]
    return sum(not rt.probes[0][2] for rt in pods), len(pods)


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _row(mode: str, xs: list[float]) -> str:
    return (f"| {mode} | {len(xs)} | {statistics.median(xs):.3f} | {min(xs):.3f} | "
            f"{max(xs):.3f} | {', '.join(f'{x:.3f}' for x in xs)} |")


def report(warm: list[float], cold: list[float], engine_cold: list[float],
           missed: tuple[int, int], trials: int) -> str:
    ratio = statistics.median(cold) / statistics.median(warm)
    cpu = platform.processor() or platform.machine()
    return f"""# Scale-up: warm pool vs. cold

Time from `replicas` 1 → 2 (a PATCH of the InferenceService's `/scale` subresource, as an
HPA does) until the second serving pod's `Ready` condition is `True` — the condition the
Service's endpoints follow; it includes the `preheat.dev/warm` readiness gate. Measured in
one run of `benchmarks/scale_up.py` on the local harness (docs/e2e.md): the API emulator,
the real operator (`preheat operator`, a subprocess), and real `preheat serve` engines with
the embedded SmolLM2-135M model started by the local kubelet test harness.

| mode | trials | median s | min s | max s | each s |
| --- | --- | --- | --- | --- | --- |
{_row("warm pool (`warmPool.size: 1`)", warm)}
{_row("cold (`warmPool.size: 0`)", cold)}

**Warm is {ratio:.0f}× faster than cold** (median {statistics.median(warm):.3f} s vs.
{statistics.median(cold):.3f} s); target warm ≤ 2 s: {"met" if max(warm) <= 2 else "NOT met"}.

What each number is made of:

- **warm**: the operator sees the `/scale` write, relabels the ready warm pod
  `role=serving` and the pod is already `Ready` — no process starts, so the time is the
  operator's reaction (watch event → reconcile → PATCH) plus this script's 20 ms polling.
  The pool is refilled afterwards, out of the user's path.
- **cold**: the operator creates a pod; the kubelet starts `preheat serve`; the engine loads
  the model (its own start-to-ready, from its log: median
  {statistics.median(engine_cold) if engine_cold else float("nan"):.1f} s here) and the
  kubelet's probes see it: first the `startupProbe` on `/health` (the operator sets
  `periodSeconds: 10`: a first probe that comes before the server listens fails, and the
  next one is 10 s later — {missed[0]} of {missed[1]} cold pods here), then the readiness
  probe on `/ready` every second, then the operator opens the pod's gate. A kubelet does
  the same with this pod spec.
- Cold is the *favourable* case for cold here: the weight cache is shared by every pod on
  this node (the harness maps the pods' `cache` emptyDir to one node directory, see
  docs/e2e.md), so no pod converts the GGUF; and the model is 135M parameters on CPU. A large
  model on a GPU node loads for minutes, which the warm pool hides the same way.

Machine: {os.cpu_count()} CPU cores ({cpu}), Python {platform.python_version()}, no GPU used;
commit {_commit()}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC,
{trials} trials per mode.
"""


async def main(trials: int, out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="preheat-scale-up-") as tmp:
        async with local_cluster(Path(tmp)) as c:
            try:
                warm = await measure(c, "bench-warm", warm_pool=1, trials=trials)
                cold = await measure(c, "bench-cold", warm_pool=0, trials=trials)
                engine_cold = engine_ready_times(c, "bench-cold")
                missed = missed_first_startup_probe(c, "bench-cold")
                for rt in c.kubelet.finished:  # the kubelet's view, for the log
                    print(rt.name, "probes (s after start, path, ok):", rt.probes[:4])
            except BaseException:
                print(c.diagnostics(), file=sys.stderr)
                raise
    out.write_text(report(warm, cold, engine_cold, missed, trials))
    print(out.read_text())


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "scale_up.md")
    a = p.parse_args()
    asyncio.run(main(a.trials, a.out))
