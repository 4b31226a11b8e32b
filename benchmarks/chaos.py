"""The chaos scenario, every event, measured: what clients see while the warm pool covers
crashes, hangs, evictions, node loss, a rollout, scaling and an operator restart.

Runs on the e2e local harness (API emulator + the real operator + the local kubelet with
three nodes + the Service stand-in; see docs/e2e.md) with continuous traffic from several
OpenAI-SDK clients through the Service. e2e/chaos.py holds the scenario and its rules.

    .venv/bin/python benchmarks/chaos.py               # -> benchmarks/results/chaos.md
    .venv/bin/python benchmarks/chaos.py --events kill,rollout --out /tmp/chaos.md
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import os
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from e2e import chaos, manifests  # noqa: E402
from e2e.local_cluster import local_cluster  # noqa: E402

SERVICE = "chat"


def header(args: argparse.Namespace, load_before: tuple[float, ...],
           load_after: tuple[float, ...]) -> str:
    spec = manifests.inference_service(SERVICE)["spec"]
    return "\n".join([
        "# Chaos: the warm pool through failure and change",
        "",
        f"Written by `benchmarks/chaos.py` on {datetime.date.today().isoformat()} "
        f"({platform.machine()}, {os.cpu_count()} CPUs, no GPU; load average "
        f"{load_before[0]:.1f} before, {load_after[0]:.1f} after — other work shared the "
        "machine). One run; the e2e local harness (API emulator, the real operator, the local "
        "kubelet with 3 nodes, the Service stand-in following ready `role=serving` pods like "
        "kube-proxy), engines are real `preheat serve` processes of the embedded SmolLM2-135M.",
        "",
        f"Service: replicas 1, `warmPool.size` 1, `failover.unreadySeconds` "
        f"{spec['failover']['unreadySeconds']}, readiness probe every "
        f"{spec['readiness']['periodSeconds']} s (3 failures), `endpointDelaySeconds` "
        f"{spec['readiness']['endpointDelaySeconds']}, rollout defaults (maxSurge 25%, "
        "maxUnavailable 0). Traffic: "
        f"{args.clients} clients, each sending streamed chat completions (max_tokens 8) one "
        "after the other with the `openai` SDK through the Service `chat`, i.e. the 2 router "
        "pods, with the clients' own retries off (one attempt each; no token in "
        f"{chaos.FIRST_TOKEN_TIMEOUT_S:.0f} s counts as failed): the router retries on another "
        "pod what failed before any byte reached the client; a request that fails after "
        "that counts as failed.",
        "",
        "Columns: *requests* are those in flight between the event and the service settling "
        "again (pool refilled, rollout done); *retried*: needed more than one attempt; "
        "*capacity lost*: seconds with fewer ready serving pods than before the event; "
        "*capacity back after*: from the event until ready serving pods = replicas again "
        "without the victim; *grace that applies*: `unreadySeconds` for a pod that is alive but "
        "unready (hang, node loss), none for a dead container or pod (kill, evict: its restart "
        "would be a cold start, so the operator fails over at once); *back after grace ends*: "
        "capacity back minus (the victim turning unready + that grace) — the issue's goal is "
        "at most 2 s; *TTFT before*: the "
        f"{args.quiet:.0f} s before the event, *during*: the requests of the row.",
    ])


async def main(args: argparse.Namespace) -> int:
    events = tuple(e for e in args.events.split(",") if e)
    unknown = set(events) - set(chaos.ALL_EVENTS)
    if unknown:
        raise SystemExit(f"unknown events {sorted(unknown)}; known: {', '.join(chaos.ALL_EVENTS)}")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="preheat-chaos-") as tmp:
        work = Path(args.workdir) if args.workdir else Path(tmp)
        async with local_cluster(work / "node") as cluster:
            try:
                run = await chaos.run(cluster, SERVICE, events, clients=args.clients,
                                      quiet_s=args.quiet)
            except BaseException:
                print(cluster.diagnostics(), file=sys.stderr)
                raise
    load_after = os.getloadavg()
    text = chaos.markdown(run, header(args, load_before, load_after))
    misses = chaos.goals(run)
    base50, base99 = chaos.ttft(run.baseline)
    text += (f"\n\nBaseline before any event: {len(run.baseline)} requests, TTFT p50 "
             f"{chaos._ms(base50)} ms, p99 {chaos._ms(base99)} ms.\n")
    notes = [f"- {e.name}: {e.note}" for e in run.events if e.note]
    if notes:
        text += "\n" + "\n".join(notes) + "\n"
    fails = [f"- {e.name}: {r.error} (attempts {r.attempts})" for e in run.events for r in e.failed]
    text += "\nFailed requests:\n" + ("\n".join(fails) if fails else "- none") + "\n"
    text += "\nGoals (no failed request for planned events; for failures only requests in " \
            "flight on the dead pod fail; no capacity lost by planned events): " + \
            ("all met.\n" if not misses else "NOT met:\n" + "\n".join(f"- {m}" for m in misses) + "\n")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(json.dumps([chaos.summary(e, run.grace_s) | {"event": e.name} for e in run.events],
                     indent=1))
    return 0 if not misses else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", default=",".join(chaos.ALL_EVENTS))
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--quiet", type=float, default=5.0,
                   help="seconds of steady traffic before each event (its TTFT baseline)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "chaos.md"))
    p.add_argument("--workdir", help="keep the harness's files (logs) here instead of a temp dir")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("httpx", "openai", "aiohttp.access", "kmock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    sys.exit(asyncio.run(main(p.parse_args())))
