"""Tensor parallelism with real processes: `LLM(..., tensor_parallel_size=2)` starts a worker
process, gloo carries the collectives on CPU, and greedy output equals the single-process
engine's token for token (fp32, tiny random-weight models of llama — one KV head, so it is
replicated on both ranks, with q/k/v/o and MLP biases —, llama with as many KV heads as
ranks, qwen3 and qwen3_moe). Snapshot KV gathered from both ranks equals a single rank's and
restores across tensor-parallel sizes in both directions. Kept lean: each TP engine costs a
process start. A process holds one tensor-parallel engine at a time (the group is the
process's default one), so the tests that share `tp2` come after the others."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed
from tiny_models import build_tiny_model

from preheat.engine import LLM
from preheat.engine.distributed.sharding import TensorParallelError
from preheat.engine.kv.snapshot import load_latest_snapshot, save_snapshot
from preheat.engine.request.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0)
# Small prefill chunks: the long prompt takes several steps, mixed with the others' decodes.
ENGINE = dict(dtype="float32", max_total_tokens=2048, chunked_prefill_size=16, weight_cache_dir="off")


def prompts(tokenizer) -> list[list[int]]:
    system = tokenizer.encode("You are a careful assistant who answers in short sentences about the weather.")
    return [system + tokenizer.encode(" What about rain?"), system + tokenizer.encode(" And snow tomorrow?"),
            tokenizer.encode("Hello there")]  # fmt: skip


def generate(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    return [r.token_ids for r in llm.generate(batch, GREEDY)]


def test_a_size_that_does_not_divide_the_model_is_refused_before_any_worker_starts(tiny_llama_dir):
    with pytest.raises(TensorParallelError, match="--tensor-parallel-size 3 does not divide .*4 attention heads"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=3, **ENGINE)
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("family", ["tiny_llama_dir", "tiny_qwen3_dir", "tiny_qwen3_moe_dir"])
def test_two_ranks_generate_what_one_does(family, request, smollm_tokenizer):
    path = str(request.getfixturevalue(family))
    batch = prompts(smollm_tokenizer)
    with LLM(path, **ENGINE) as one:
        want = generate(one, batch)
    with LLM(path, tensor_parallel_size=2, **ENGINE) as two:
        assert two.engine.pool.kv.shape[-2] == one.engine.pool.kv.shape[-2] // 2  # KV heads split
        assert generate(two, batch) == want


def test_two_ranks_with_int8_weights_generate_what_one_does(tiny_llama_dir, smollm_tokenizer):
    """Each rank quantizes whole matrices and cuts its slice at block boundaries (a worker
    quantizes what it reads from the checkpoint itself), so the int8 shards sum to one rank's."""
    batch = prompts(smollm_tokenizer)
    with LLM(str(tiny_llama_dir), quantization="int8", **ENGINE) as one:
        want = generate(one, batch)
    with LLM(str(tiny_llama_dir), tensor_parallel_size=2, quantization="int8", **ENGINE) as two:
        assert two.engine.model.layers[0].attn.o.kind.startswith("int8")
        assert generate(two, batch) == want


@pytest.fixture(scope="module")
def replicated_kv_dir(tmp_path_factory, smollm_tokenizer):
    """4 query heads, 1 KV head (replicated on both ranks), every bias random."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-gqa"), "llama", smollm_tokenizer,
                            num_key_value_heads=1, attention_bias=True, mlp_bias=True)  # fmt: skip


@pytest.fixture(scope="module")
def tp2(replicated_kv_dir):
    llm = LLM(str(replicated_kv_dir), tensor_parallel_size=2, **ENGINE)
    yield llm
    procs = llm.engine.tp.procs
    llm.close()
    assert all(p.poll() is not None for p in procs), "a worker outlived close()"


def test_two_ranks_generate_what_one_does_with_a_replicated_kv_head(tp2, replicated_kv_dir, smollm_tokenizer):
    engine = tp2.engine
    assert engine.pool.kv.shape[-2] == 1 and engine.model.layers[0].attn.num_heads == 2
    batch = prompts(smollm_tokenizer)
    with LLM(str(replicated_kv_dir), **ENGINE) as one:
        want = generate(one, batch)
    assert generate(tp2, batch) == want
    assert generate(tp2, batch) == want  # again, from the prefix cache


def test_snapshots_hold_every_kv_head_and_restore_across_sizes(tp2, replicated_kv_dir, smollm_tokenizer, tmp_path):
    first = prompts(smollm_tokenizer)[0]
    third = smollm_tokenizer.encode("Trains leave the central station every ten minutes; the timetable changes in "
                                    "winter, when the mountain line closes for snow and the buses take over.")
    generate(tp2, [first])
    with LLM(str(replicated_kv_dir), **ENGINE) as one:
        want_first, want_third = generate(one, [first]), generate(one, [third])
        # What the pool reads out of both ranks is the KV one rank holds for the same tokens.
        aligned = first[: len(first) // 16 * 16]
        pages = {e: e.engine.radix.match_prefix(aligned, touch=False).pages for e in (one, tp2)}
        assert len(pages[one]) == len(pages[tp2]) == len(aligned) // 16
        whole = one.engine.pool.read_pages(pages[one])
        gathered = tp2.engine.pool.read_pages(pages[tp2])
        assert gathered.shape == whole.shape  # every KV head, though each rank holds one
        torch.testing.assert_close(gathered, whole, rtol=1e-4, atol=1e-4)
        one_records, one_fingerprint = one.engine.export_prefixes(None), one.engine.fingerprint
    assert tp2.engine.fingerprint == one_fingerprint  # sharding is not part of the fingerprint

    # TP 2 -> TP 1: the manifest says how it was written; a single rank restores it.
    path = save_snapshot(tmp_path / "from-tp2", tp2.engine.fingerprint, tp2.engine.export_prefixes(None), "tp2",
                         sharding=tp2.engine.sharding)  # fmt: skip
    assert json.loads((path / "manifest.json").read_text())["sharding"] == {"tensor_parallel_size": 2,
                                                                            "kv_heads": "all"}
    with LLM(str(replicated_kv_dir), **ENGINE) as fresh:
        loaded = load_latest_snapshot(tmp_path / "from-tp2", fresh.engine.fingerprint)
        assert fresh.engine.import_prefixes(loaded.records) > 0
        result = fresh.generate([first], GREEDY)[0]
        assert result.cached_tokens >= 16 and [result.token_ids] == want_first

    # TP 1 -> TP 2: split by head on the way into both ranks' pools (only `third` is new there).
    save_snapshot(tmp_path / "from-tp1", one_fingerprint, one_records, "tp1")
    loaded = load_latest_snapshot(tmp_path / "from-tp1", tp2.engine.fingerprint)
    assert tp2.engine.import_prefixes(loaded.records) > 0
    result = tp2.generate([third], GREEDY)[0]
    assert result.cached_tokens >= 16 and [result.token_ids] == want_third


def _listening(pid: int) -> list[str]:
    """The local addresses of the TCP sockets process `pid` listens on (from /proc)."""
    import os

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                found.append(cols[1])
    return found


def test_the_rendezvous_and_collectives_listen_on_loopback_only(tp2):
    """A TCPStore listens on every interface (no auth): anyone who reaches the pod could
    join the rendezvous. The ranks meet through a file store, and gloo's sockets bind lo."""
    import os

    loopback = ("0100007F", "00000000000000000000000001000000")  # 127.0.0.1, ::1 (little-endian words)
    for pid in [os.getpid(), *(p.pid for p in tp2.engine.tp.procs)]:
        listening = _listening(pid)
        assert all(addr.split(":")[0] in loopback for addr in listening), (pid, listening)
    assert os.environ.get("GLOO_SOCKET_IFNAME") == "lo"
