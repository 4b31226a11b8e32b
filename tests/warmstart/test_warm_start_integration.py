"""Warm start end to end on real `preheat serve` processes (issue 4, items 1 and 2).

One story, shared by the tests to keep server starts few (each costs seconds on CPU):

1. `first`: templates + an empty snapshot dir. /ready is 503 while it restores and warms,
   200 only after the warmup finished; /admin/* answers the peer secret only (not the
   clients' API key, not a wrong secret, not nobody); SIGTERM saves a snapshot.
2. Three servers start together:
   - `restarted` (writer-a) and `twin` (writer-b) on the first server's snapshot dir, with no
     templates, so only the snapshot can make the first request's system prompt a cache hit;
   - `refusing` on a dir holding one damaged copy of that snapshot per kind of damage, all
     newer than one good copy: every damage is refused (log + metric reason) and the good
     copy is restored. It has no peer secret (a standalone engine trusting its own dir),
     so the damage, not the signature, is what refuses each copy.
3. A server with an empty snapshot dir fetches the newest snapshot from `restarted` (its
   peer) over HTTP and restores its hot prefixes (pod-local snapshots, any storage).
4. `restarted` and `twin` snapshot at once into their shared dir, then stop at once: every
   snapshot is valid and the newest one is what a reader restores.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from preheat.engine.kv.snapshot import list_snapshots, load_latest_snapshot, read_snapshot
from preheat.engine.warm.builtin_warmup import builtin_templates
from preheat.engine.warm.warmup_runner import chat_pin_ids
from preheat.engine.warm.warmup_templates import build_plan, load_templates

from .bad_snapshots import DAMAGES, copy_as, make_bad_snapshots
from .serve_helpers import Server, chat, metric, start

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ORDER_PREFIX = (
    "You read messages sent to the Northwind Outfitters support desk and reply with the order "
    "number they mention, written as NW- followed by eight digits, or with the word unknown "
    "when the message names no valid order number.\n"
)


@pytest.fixture(scope="module")
def system_prompt() -> str:
    """The shipped customer-service system prompt: long (~560 tokens) and business-shaped."""
    doc = yaml.safe_load((REPO / "warmup_templates" / "customer_service.yaml").read_text())
    return doc["templates"][0]["system"]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from preheat.engine.model.loader import DEFAULT_GGUF_NAME, DEFAULT_GGUF_PACKAGE

    folder = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE).submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file=DEFAULT_GGUF_NAME)


@pytest.fixture(scope="module")
def template_dir(tmp_path_factory, system_prompt) -> Path:
    """A chat template with a pinned system prompt and a regex template with a pinned prefix,
    kept short so warmup takes seconds on CPU."""
    d = tmp_path_factory.mktemp("templates")
    (d / "support.yaml").write_text(yaml.safe_dump({"templates": [
        {"name": "support-chat", "system": system_prompt,
         "conversations": [[{"role": "user", "content": "Where is my order NW-20481377?"}]],
         "concurrency": [1, 2], "max_tokens": 2},
        {"name": "order-check", "prefix": ORDER_PREFIX,
         "prompts": ["Message: 'My order is NW-20481377.'\nOrder number:"],
         "structured": [{"regex": "NW-[0-9]{8}|unknown"}], "max_tokens": 12},
    ]}))
    return d


@dataclass
class FirstRun:
    server: Server
    snapshots: Path
    ready_metrics: str
    ready_body: dict
    admin_statuses: dict[str, tuple[int, int]]  # credential -> (POST save, GET export)
    admin: dict
    exit_code: int
    log: str


@pytest.fixture(scope="module")
def first(tmp_path_factory, template_dir) -> FirstRun:
    tmp = tmp_path_factory.mktemp("first")
    snapshots = tmp / "snapshots"
    snapshots.mkdir()
    srv = start(tmp, "--warmup-templates", str(template_dir), "--snapshot-dir", str(snapshots),
                name="first")
    try:
        srv.wait_ready()
        ready_metrics = srv.metrics()
        ready_body = httpx.get(srv.url + "/ready", timeout=10).json()
        # The leak: the export holds every client's recent conversations (token ids).
        tries = {"none": {}, "client api key": srv.auth(),
                 "wrong peer secret": {"Authorization": "Bearer warm-peer-secret-guess"}}
        statuses = {}
        for who, headers in tries.items():
            save = httpx.post(srv.url + "/admin/snapshot", headers=headers, timeout=60)
            export = httpx.get(srv.url + "/admin/snapshot/latest", headers=headers, timeout=60)
            statuses[who] = (save.status_code, export.status_code)
        admin = httpx.post(srv.url + "/admin/snapshot", headers=srv.peer_auth(), timeout=120)
        assert admin.status_code == 200, admin.text
    finally:
        code = srv.stop()
    return FirstRun(srv, snapshots, ready_metrics, ready_body, statuses, admin.json(), code, srv.log())


def fingerprint_of(snapshot: Path) -> dict:
    return json.loads((snapshot / "manifest.json").read_text())["fingerprint"]


@dataclass
class SecondWave:
    restarted: Server
    twin: Server
    refusing: Server
    good_copy: Path
    bad: dict[str, Path]


@pytest.fixture(scope="module")
def second(tmp_path_factory, first) -> SecondWave:
    tmp = tmp_path_factory.mktemp("second")
    newest = list_snapshots(first.snapshots)[0]
    bad_dir = tmp / "bad-snapshots"
    bad_dir.mkdir()
    good_copy = copy_as(newest, bad_dir, 1_000_000, "good")
    bad = make_bad_snapshots(newest, bad_dir, 2_000_000)
    # What these servers test is the snapshot; the built-in warmup ran (and was counted) in `first`.
    shared = ["--snapshot-dir", str(first.snapshots), "--skip-server-warmup"]
    servers = [
        start(tmp, *shared, name="restarted", env={"HOSTNAME": "writer-a"}),
        start(tmp, *shared, name="twin", env={"HOSTNAME": "writer-b"}),
        # Every damage is read before the good copy: more candidates than the default 4.
        start(tmp, "--snapshot-dir", str(bad_dir), "--snapshot-restore-candidates", "16",
              "--skip-server-warmup", name="refusing", peer=False),
    ]
    try:
        for s in servers:
            s.wait_ready()
        yield SecondWave(*servers, good_copy, bad)
    finally:
        for s in servers:
            s.stop()


# --------------------------------------------------------------------------- 1. first start


def test_ready_is_503_until_the_warmup_has_run_then_200(first, template_dir):
    statuses = [(status, phase) for _, status, phase in first.server.phases]
    assert statuses[-1] == (200, "ready")
    assert all(status == 503 for status, _ in statuses[:-1])
    assert (503, "warming") in statuses
    # Everything the plan holds ran before the phase turned ready, and was reported.
    log = first.log
    assert log.index("warmup: ") < log.index("phase: warming -> ready")
    assert "warmed support-chat: pinned 1 prefix(es)" in log
    assert "warmed order-check: pinned 1 prefix(es)" in log and "grammars regex" in log
    for name in ("builtin-chat", "builtin-sampling", "builtin-json", "builtin-tools", "builtin-prefill"):
        line = next(x for x in log.splitlines() if f"warmed {name}: " in x)
        assert "refused" not in line and "0 request(s)" not in line, line
    # Every path both name was warmed, each once: what ran is what the log reports (pins and
    # the prompts prefilled before the staggered wave included), never more than running
    # every request of both plans plus a prefill per pin and per prefilled prompt.
    plan = build_plan(load_templates(template_dir), max_concurrency=8)
    builtin = build_plan(builtin_templates(512, 16))
    ran = sum(int(n) for n in re.findall(r"warmup: (\d+) request\(s\) from", log))
    primed = sum(int(n) for n in re.findall(r"warmup: prefilled (\d+) prompt", log))
    assert metric(first.ready_metrics, "preheat_warmup_requests_total") == ran
    assert 0 < ran <= plan.num_requests + len(plan.pins) + builtin.num_requests + primed
    steps = first.ready_body["startup_steps"]
    assert {"imports", "load", "warmup", "templates", "snapshot"} <= set(steps), steps
    assert metric(first.ready_metrics, "preheat_warmup_seconds") > 0


def test_admin_answers_only_the_peer_secret_and_reports_path_and_tokens(first):
    assert first.admin_statuses == {"none": (401, 401), "client api key": (401, 401),
                                    "wrong peer secret": (401, 401)}
    assert Path(first.admin["path"]).parent == first.snapshots
    assert first.admin["tokens"] > 0 and first.admin["prefixes"] >= 2  # both pins at least


def test_sigterm_drains_then_saves_a_snapshot_and_exits_0(first, tokenizer, system_prompt):
    assert first.exit_code == 0
    assert first.log.index("draining") < first.log.index("snapshot at shutdown: ")
    snaps = list_snapshots(first.snapshots)
    assert len(snaps) == 2  # the admin one and the shutdown one
    records, _ = read_snapshot(snaps[0], fingerprint_of(snaps[0]))
    pinned = [r for r in records if r.pinned]
    pin = chat_pin_ids(tokenizer, system_prompt)
    assert any(r.token_ids == pin[: r.num_tokens] and r.num_tokens >= len(pin) - 15 for r in pinned)


# --------------------------------------------------------------------------- 2. restart


def test_first_request_after_restart_finds_the_pinned_prefix_in_the_cache(
    second, tokenizer, system_prompt
):
    pin_tokens = len(chat_pin_ids(tokenizer, system_prompt))
    body = chat(second.restarted, system_prompt, "Can I return sandals that I wore once indoors?")
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 0.95 * pin_tokens, (cached, pin_tokens)
    text = second.restarted.metrics()
    restored = metric(text, "preheat_snapshot_restored_tokens")
    assert restored >= cached  # no templates ran: the snapshot is the only way it was cached
    assert metric(text, "preheat_kv_tier_hit_tokens_total", tier="l1") >= cached


def test_every_damaged_snapshot_is_refused_and_the_engine_still_becomes_ready(second):
    text = second.refusing.metrics()
    expected: dict[str, int] = {}
    for _, reason in DAMAGES.values():
        expected[reason] = expected.get(reason, 0) + 1
    for reason, count in expected.items():
        assert metric(text, "preheat_snapshot_rejected_total", reason=reason) == count, reason
    log = second.refusing.log()
    for name, (_, reason) in DAMAGES.items():
        assert f"path={second.bad[name]} reason={reason}" in log, name
    # Newest valid wins: after refusing every newer one, the good (oldest) copy is restored.
    assert f"snapshot restored: path={second.good_copy} " in log
    assert metric(text, "preheat_snapshot_restored_tokens") > 0
    assert httpx.get(second.refusing.url + "/ready").status_code == 200


def test_a_pod_with_an_empty_snapshot_dir_restores_its_peers_hot_prefixes(
    second, tmp_path_factory, tokenizer, system_prompt
):
    """Pod-local snapshots (any storage): a new engine with an empty directory fetches the
    newest snapshot from a ready peer over HTTP (with the peer secret) before it turns ready,
    and its first request finds the peer's pinned prefix in the cache."""
    tmp = tmp_path_factory.mktemp("peer")
    own = tmp / "snapshots"
    srv = start(tmp, "--snapshot-dir", str(own), "--snapshot-peer-url", second.restarted.url,
                name="from-peer")
    try:
        srv.wait_ready()
        text = srv.metrics()
        assert metric(text, "preheat_snapshot_peer_fetches_total", result="fetched") == 1
        pin_tokens = len(chat_pin_ids(tokenizer, system_prompt))
        body = chat(srv, system_prompt, "Do you ship to Norway?")
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 0.95 * pin_tokens, (cached, pin_tokens)
        assert metric(text, "preheat_snapshot_restored_tokens") >= cached
        assert len(list_snapshots(own)) == 1  # the peer's snapshot, now the pod's own
    finally:
        srv.stop()


def test_two_writers_sharing_one_directory_leave_only_valid_snapshots_newest_wins(second, first):
    pair = (second.restarted, second.twin)

    def snapshot(server: Server) -> tuple[str, httpx.Response]:
        return server.url, httpx.post(server.url + "/admin/snapshot", headers=server.peer_auth(),
                                      timeout=120)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(snapshot, [s for _ in range(2) for s in pair]))
        # Each server saves one snapshot at a time: a second request while one runs is a 409,
        # one right after it a 429 (forced saves are rate-limited).
        for server in pair:
            mine = [r for url, r in answers if url == server.url]
            assert any(r.status_code == 200 for r in mine), [r.text for r in mine]
            assert all(r.status_code == 200 or r.json()["error"]["code"] in
                       ("snapshot_in_progress", "snapshot_too_soon") for r in mine)
        saved = [r.json() for _, r in answers if r.status_code == 200]
        codes = list(pool.map(lambda s: s.stop(), pair))  # and both save again at shutdown
    assert codes == [0, 0]
    writers = {Path(s["path"]).name[len("snap-") + 21 : -9] for s in saved}  # snap-<ns>-<writer>-<hex>
    assert writers == {"writer-a", "writer-b"}

    root = first.snapshots
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    snaps = list_snapshots(root)
    fp = fingerprint_of(snaps[0])
    created = {}
    for snap in snaps:  # each one passes every check (read_snapshot raises otherwise)
        _, manifest = read_snapshot(snap, fp)
        created[snap] = manifest["created_at"]
    latest = load_latest_snapshot(root, fp)
    assert latest.rejected == []
    assert latest.path == max(created, key=created.get)


# --------------------------------------------------------------------------- 3. bad templates


def test_an_invalid_template_fails_the_start_at_once_naming_file_and_field(tmp_path):
    (tmp_path / "broken.yaml").write_text("name: x\nprompts: [hi]\nmax_tokens: lots\n")
    done = subprocess.run(
        [sys.executable, "-m", "preheat", "serve", "--port", "1", "--warmup-templates", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2
    assert "broken.yaml: max_tokens:" in done.stderr
    assert "loading model" not in done.stderr  # refused before the model loads

