"""Side-by-side throughput: Preheat's engine vs transformers `generate` (and llama.cpp on the
same GGUF when llama-cpp-python is importable), one process, one workload.

Workload: N concurrent multi-turn conversations sharing a ~300-token system prompt; each
turn appends a user message to the conversation so far and generates a reply. Preheat gets
the turns as they come (a conversation's next turn is queued as soon as its reply is done:
continuous batching, radix prefix cache). transformers runs each turn as one left-padded
batch through `generate` with its own KV cache, the way a simple server would.

Writes benchmarks/results/engine_vs_hf.md.

    python benchmarks/engine_vs_hf.py [--conversations 16] [--turns 3] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from preheat.engine import SamplingParams
from preheat.engine.config import EngineConfig
from preheat.engine.engine import Engine

RESULTS = Path(__file__).parent / "results"

SYSTEM_PROMPT = (
    "You are Aria, the customer-support assistant of Northwind Outdoor Gear, an online shop "
    "for hiking, climbing and camping equipment. Be friendly, precise and brief. Policies you "
    "must follow: orders ship within two business days from our warehouse in Denver; standard "
    "shipping is free above 75 dollars, otherwise 6.95 dollars; express shipping costs 19 "
    "dollars and arrives in one to two days. Returns are accepted within 60 days for unused "
    "items in original packaging, and within 30 days for used items with a defect. Refunds go "
    "to the original payment method within five business days after the return arrives. "
    "Tents, sleeping bags and backpacks carry a two-year warranty against manufacturing "
    "defects; climbing hardware is never returnable once used, for safety reasons. Never "
    "promise discounts. If a customer is upset, apologise once and offer a concrete next "
    "step. If you do not know an answer, say so and offer to connect the customer with a "
    "human agent. Always answer in the customer's language, and keep answers under 80 words. "
    "Order numbers have the form 10 followed by digits; ask for it before looking anything up. "
    "Gift cards cannot be refunded or exchanged for cash. Price matching is not offered. For "
    "orders to Canada, shipping costs 14 dollars and customs fees are paid by the customer on "
    "delivery; we do not ship to other countries yet. Our support hours are 8am to 8pm Mountain "
    "time on weekdays and 9am to 5pm on weekends."
)

USER_TURNS = [
    ["Hi! Where is my order 10{c}? I ordered a tent last week.", "Can I switch to express shipping?",
     "Thanks. And if the tent leaks, what do I do?"],
    ["Do you ship to Canada?", "How much would a 60 dollar order cost to ship?", "Okay, what about returns?"],
    ["My carabiner {c} arrived scratched.", "I already used it once, can I return it?", "Fine, can I talk to a human?"],
    ["What sleeping bag do you recommend for minus 10 degrees?", "Is it covered by warranty?",
     "How long does a refund take if I return it?"],
]


def conversation_messages(c: int, turn: int, replies: list[str]) -> list[dict[str, str]]:
    script = USER_TURNS[c % len(USER_TURNS)]
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for t in range(turn + 1):
        messages.append({"role": "user", "content": script[t % len(script)].format(c=c)})
        if t < turn:
            messages.append({"role": "assistant", "content": replies[t]})
    return messages


def chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


def run_preheat(engine: Engine, n_conv: int, turns: int, max_tokens: int) -> dict:
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    replies: list[list[str]] = [[] for _ in range(n_conv)]
    turn_of = [0] * n_conv
    submitted: dict[str, tuple[int, float]] = {}
    ttft: dict[int, list[float]] = {t: [] for t in range(turns)}
    first_seen: set[str] = set()
    gen_tokens = prompt_tokens = 0
    before = engine.stats()

    def submit(c: int) -> None:
        nonlocal prompt_tokens
        ids = chat_ids(tok, conversation_messages(c, turn_of[c], replies[c]))
        prompt_tokens += len(ids)
        rid = engine.add_request(ids, params)
        submitted[rid] = (c, time.perf_counter())

    # Which kind of step each engine.step() was, to say where the time goes.
    kinds: list[str] = []
    prepare = engine.runner.prepare

    def recording_prepare(decode, extend):
        kinds.append("decode" if not extend else "prefill" if not decode else "mixed")
        return prepare(decode, extend)

    engine.runner.prepare = recording_prepare
    step_times: dict[str, list[float]] = {"decode": [], "prefill": [], "mixed": []}
    start = time.perf_counter()
    for c in range(n_conv):
        submit(c)
    while engine.has_unfinished():
        t_step, n_kinds = time.perf_counter(), len(kinds)
        outs = engine.step()
        if len(kinds) > n_kinds:
            step_times[kinds[-1]].append(time.perf_counter() - t_step)
        for out in outs:
            c, t0 = submitted[out.request_id]
            if out.request_id not in first_seen and out.token_ids:
                first_seen.add(out.request_id)
                ttft[turn_of[c]].append(time.perf_counter() - t0)
            if out.finished:
                gen_tokens += len(out.token_ids)
                replies[c].append(out.text)
                turn_of[c] += 1
                if turn_of[c] < turns:
                    submit(c)
    wall = time.perf_counter() - start
    engine.runner.prepare = prepare
    after = engine.stats()
    hit = (after.cached_tokens_total - before.cached_tokens_total) / max(
        1, after.prompt_tokens_total - before.prompt_tokens_total
    )
    return dict(
        wall=wall, gen_tokens=gen_tokens, prompt_tokens=prompt_tokens, ttft=ttft, hit_rate=hit, steps=step_times
    )


def run_transformers(model, tok, n_conv: int, turns: int, max_tokens: int) -> dict:
    from transformers import LogitsProcessor, LogitsProcessorList

    class FirstToken(LogitsProcessor):
        def __init__(self) -> None:
            self.first: float | None = None

        def __call__(self, input_ids, scores):
            if self.first is None:
                self.first = time.perf_counter()
            return scores

    tok.padding_side = "left"
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    replies: list[list[str]] = [[] for _ in range(n_conv)]
    ttft: dict[int, list[float]] = {t: [] for t in range(turns)}
    gen_tokens = prompt_tokens = 0
    start = time.perf_counter()
    for turn in range(turns):
        batch = [chat_ids(tok, conversation_messages(c, turn, replies[c])) for c in range(n_conv)]
        prompt_tokens += sum(len(b) for b in batch)
        width = max(len(b) for b in batch)
        ids = torch.tensor([[pad] * (width - len(b)) + b for b in batch])
        mask = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch])
        probe = FirstToken()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                do_sample=False, logits_processor=LogitsProcessorList([probe]), pad_token_id=pad,
            )
        ttft[turn].extend([(probe.first or time.perf_counter()) - t0] * n_conv)
        for c in range(n_conv):
            new = out[c, width:].tolist()
            gen_tokens += len(new)
            replies[c].append(tok.decode(new, skip_special_tokens=True))
    wall = time.perf_counter() - start
    return dict(wall=wall, gen_tokens=gen_tokens, prompt_tokens=prompt_tokens, ttft=ttft, hit_rate=0.0)


def run_llama_cpp(gguf: str, tok, n_conv: int, turns: int, max_tokens: int) -> dict | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    from llama_cpp import Llama

    threads = torch.get_num_threads()  # llama-cpp-python's default is half the cores
    llm = Llama(model_path=gguf, n_ctx=4096, n_threads=threads, n_threads_batch=threads, verbose=False)
    replies: list[list[str]] = [[] for _ in range(n_conv)]
    ttft: dict[int, list[float]] = {t: [] for t in range(turns)}
    gen_tokens = prompt_tokens = 0
    start = time.perf_counter()
    for turn in range(turns):
        for c in range(n_conv):  # llama-cpp-python serves one sequence at a time
            ids = chat_ids(tok, conversation_messages(c, turn, replies[c]))
            prompt_tokens += len(ids)
            t0 = time.perf_counter()
            text, first = [], None
            for chunk in llm.create_completion(ids, max_tokens=max_tokens, temperature=0, stream=True):
                if first is None:
                    first = time.perf_counter() - t0
                text.append(chunk["choices"][0]["text"])
                gen_tokens += 1
            ttft[turn].append(first or 0.0)
            replies[c].append("".join(text))
    wall = time.perf_counter() - start
    return dict(wall=wall, gen_tokens=gen_tokens, prompt_tokens=prompt_tokens, ttft=ttft, hit_rate=float("nan"))


def memory_bandwidth_gbps() -> float:
    """Read bandwidth, the resource a decode step spends: weights are only read
    (benchmarks/bandwidth.py, which decode_step.py uses for its floors too)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import bandwidth

    return bandwidth.read_gbps()


def matmul_floor_ms(engine: Engine, rows: int, repeats: int = 5) -> float:
    """The matrix multiplies of one decode step at `rows` rows and nothing else (every
    layer's four matrices and the LM head, the engine's own weights and kernels): the part
    of a step no scheduling or attention work can remove. Best of `repeats`."""
    from preheat.engine.kernels import linear

    model = engine.model
    x = torch.randn(rows, model.spec.hidden_size, dtype=engine.dtype)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            for layer in model.layers:  # a dense model (the embedded SmolLM2)
                attn, mlp = layer.attn, layer.mlp
                linear.apply(x, attn.qkv)
                linear.apply(x, attn.o)
                linear.apply(x, mlp.gate_up)
                linear.apply(torch.randn(rows, mlp.intermediate_size, dtype=engine.dtype), mlp.down)
            linear.apply(x, model.lm_head)
            best = min(best, time.perf_counter() - t0)
    return best * 1000


def batch1_decode(engine: Engine, tokens: int = 64) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    engine.add_request(engine.tokenizer.encode("Write a long story about a lighthouse keeper."), params)
    t_first = None
    count = 0
    while engine.has_unfinished():
        for out in engine.step():
            count += len(out.new_token_ids)
            if t_first is None and out.token_ids:
                t_first, count = time.perf_counter(), 0
    return count / (time.perf_counter() - t_first)


def summarise(name: str, r: dict, turns: int) -> dict:
    later = [x for t in range(1, turns) for x in r["ttft"][t]]
    return dict(
        name=name,
        wall=r["wall"],
        tok_s=r["gen_tokens"] / r["wall"],
        total_tok_s=(r["gen_tokens"] + r["prompt_tokens"]) / r["wall"],
        ttft_p50=pct([x for t in r["ttft"] for x in r["ttft"][t]], 50),
        ttft_p99=pct([x for t in r["ttft"] for x in r["ttft"][t]], 99),
        later_p50=pct(later, 50),
        later_p99=pct(later, 99),
        first_p50=pct(r["ttft"][0], 50),
        hit=r["hit_rate"],
    )


def median_row(runs: list[dict]) -> dict:
    """Each metric's median over repeated runs of one side."""
    row = {"name": runs[0]["name"]}
    for key in runs[0]:
        if key != "name":
            row[key] = statistics.median(r[key] for r in runs)
    return row


def step_breakdown(results: list[dict]) -> str:
    parts = []
    for kind in ("decode", "mixed", "prefill"):
        times = [t for r in results for t in r["steps"][kind]]
        if times:
            parts.append(
                f"{len(times) / len(results):.0f} {kind} steps per run, median {1000 * statistics.median(times):.0f} ms"
            )
    return "; ".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each side, alternated; medians reported")
    ap.add_argument("--out", default=str(RESULTS / "engine_vs_hf.md"))
    ap.add_argument("--skip-decode-step", action="store_true", help="leave out benchmarks/decode_step.py's section")
    args = ap.parse_args()

    # quantization="none": the same (dequantized) weights transformers reads from the GGUF
    engine = Engine(EngineConfig(dtype=args.dtype, max_total_tokens=65536, max_num_seqs=64, quantization="none"))
    if engine.weight_move is not None:  # the weights in huge pages, as a server has them once it serves
        engine.weight_move.finish()
    tok = engine.tokenizer
    system_tokens = len(tok.encode(SYSTEM_PROMPT))
    print(f"system prompt: {system_tokens} tokens; threads: {torch.get_num_threads()}", file=sys.stderr)

    # One short warm-up each so neither side pays one-time costs inside the measurement.
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(engine.hf_dir, dtype=getattr(torch, args.dtype))
    hf.eval()
    run_preheat(engine, 2, 1, 4)
    run_transformers(hf, tok, 2, 1, 4)
    engine.radix.reset()

    # Alternate the two sides and report medians: this VM's speed drifts by up to 2x over
    # minutes, and alternating exposes both sides to the same drift.
    ours_runs, theirs_runs, preheat_results = [], [], []
    for _ in range(args.repeats):
        engine.radix.reset()
        r = run_preheat(engine, args.conversations, args.turns, args.max_tokens)
        preheat_results.append(r)
        ours_runs.append(summarise("preheat", r, args.turns))
        r = run_transformers(hf, tok, args.conversations, args.turns, args.max_tokens)
        theirs_runs.append(summarise("transformers generate (batched)", r, args.turns))
    rows = [median_row(ours_runs), median_row(theirs_runs)]
    gguf = engine.config.model
    if gguf is None:
        from preheat.engine.model.loader import default_model_path

        gguf = default_model_path()
    r = run_llama_cpp(gguf, tok, args.conversations, args.turns, args.max_tokens)
    if r is not None:
        rows.append(summarise("llama.cpp (llama-cpp-python)", r, args.turns))

    bw = memory_bandwidth_gbps()
    # What one decode step streams: every layer's matrices and the LM head (the input
    # embedding is a lookup of a few rows, and with tied weights it is the LM head anyway).
    weight_bytes = engine.model.step_weight_bytes
    engine.radix.reset()
    b1 = batch1_decode(engine)
    limit = bw * 1e9 / weight_bytes
    floor_ms = matmul_floor_ms(engine, args.conversations)

    ours, theirs = rows[0], rows[1]
    lines = [
        "# Engine vs transformers: multi-turn chat throughput",
        "",
        f"Model: SmolLM2-135M-Instruct (embedded GGUF, dequantised), dtype {args.dtype}, CPU, "
        f"{torch.get_num_threads()} threads. Workload: {args.conversations} concurrent conversations x "
        f"{args.turns} turns, shared system prompt of {system_tokens} tokens, {args.max_tokens} new tokens "
        "per turn (greedy, eos ignored so both sides generate the same count). Measured in one process "
        f"after a short warm-up of each; the two sides ran {args.repeats} times each, alternating, and "
        "every cell is the median over those runs.",
        "",
        "| engine | wall s | gen tok/s | (prompt+gen) tok/s | TTFT p50 s | TTFT p99 s | TTFT turn 1 p50 s | TTFT later turns p50 s | later p99 s | prefix hit rate |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(
            f"| {row['name']} | {row['wall']:.2f} | {row['tok_s']:.1f} | {row['total_tok_s']:.0f} | "
            f"{row['ttft_p50']:.3f} | {row['ttft_p99']:.3f} | {row['first_p50']:.3f} | {row['later_p50']:.3f} | "
            f"{row['later_p99']:.3f} | {row['hit']:.2f} |"
        )
    lines += [
        "",
        f"- Throughput ratio (generated tok/s): **{ours['tok_s'] / theirs['tok_s']:.1f}x** transformers (target >= 5x).",
        f"- TTFT on turns after the first, p50: **{theirs['later_p50'] / ours['later_p50']:.1f}x** better "
        f"than transformers (target >= 10x); p99: {theirs['later_p99'] / ours['later_p99']:.1f}x.",
        "- Per run (Preheat run i against transformers run i): throughput "
        + ", ".join(f"{o['tok_s'] / t['tok_s']:.1f}x" for o, t in zip(ours_runs, theirs_runs))
        + "; later-turn TTFT p50 "
        + ", ".join(f"{t['later_p50'] / o['later_p50']:.1f}x" for o, t in zip(ours_runs, theirs_runs))
        + ".",
        f"- Batch-1 decode: {b1:.1f} tok/s. Memory-bandwidth limit: {weight_bytes / 1e6:.0f} MB of weights per "
        f"step / {bw:.1f} GB/s measured read bandwidth = {limit:.0f} tok/s; we reach {100 * b1 / limit:.0f}% of it.",
    ]
    if len(rows) < 3:
        lines.append("- llama.cpp: llama-cpp-python not importable in this run (it is not installed in CI; see the issue for how to build it).")
    else:
        lines.append(
            "- llama.cpp (llama-cpp-python) ran once (about 50 s a run). It serves one sequence at a time: its TTFT is measured from the moment "
            "each request is handed to it, after the ones before it finished, so it leaves out queueing; "
            "compare its wall time."
        )
    load = os.getloadavg()[0]
    lines += [
        "",
        f"1-minute load average at the end of the run: {load:.2f} (2 cores, a shared VM: repeated runs "
        "vary by up to 2x in absolute time; ratios move less).",
        "",
        "Where the time goes: generation is {gen} tokens per side; transformers also re-prefills every "
        "conversation each turn, while Preheat's radix cache serves {hit:.0%} of prompt tokens. Preheat's "
        "steps: {steps}. A turn of {turns} tokens per conversation needs at least {turns_minus} decode steps "
        "in a row whatever the batching. The matrix multiplies of one {rows}-row decode step alone take "
        "{floor:.0f} ms here (measured, Preheat's bfloat16 kernels; reading the ~{mb:.0f} MB of weights at the measured "
        "bandwidth would take {bw_ms:.0f} ms), and transformers pays the same multiplies per step; the rest "
        "of a decode step is attention over the paged cache, element-wise work and the Python around the "
        "kernel calls (see the decode-step section below). So the throughput ratio is capped well below the prefill saving: with every decode "
        "step at the multiply floor and no prefill at all, Preheat's wall time would be {best:.1f} s, "
        "{best_ratio:.1f}x transformers'.".format(
            gen=args.conversations * args.turns * args.max_tokens,
            hit=ours["hit"],
            steps=step_breakdown(preheat_results),
            turns=args.max_tokens,
            turns_minus=args.max_tokens - 1,
            rows=args.conversations,
            floor=floor_ms,
            mb=weight_bytes / 1e6,
            bw_ms=weight_bytes / (bw * 1e9) * 1000,
            best=args.turns * (args.max_tokens - 1) * floor_ms / 1000,
            best_ratio=theirs["wall"] / (args.turns * (args.max_tokens - 1) * floor_ms / 1000),
        ),
    ]
    if not args.skip_decode_step:
        sys.path.insert(0, str(Path(__file__).parent))
        import decode_step

        del hf, engine  # the decode-step run loads its own engines
        lines += ["", decode_step.run(decode_step.parse_args([])).rstrip("\n")]
    builds = RESULTS / "cpu_builds.md"
    if builds.exists():  # its own run (two processes: one of them emulates an AVX2-only CPU)
        body = builds.read_text().split("\n", 1)[1].strip()
        lines += ["", "## Every CPU, every dtype (from benchmarks/cpu_builds.py, results/cpu_builds.md)", "", body]
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
