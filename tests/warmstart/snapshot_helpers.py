"""Small builders shared by the snapshot tests (also importable by a spawned writer process)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from preheat.engine.kv.snapshot import PrefixRecord, model_fingerprint, tokenizer_hash

LAYERS, KV_HEADS, HEAD_DIM, PAGE = 2, 2, 4, 4


def fingerprint(**overrides) -> dict:
    args = dict(
        architecture="LlamaForCausalLM",
        num_layers=LAYERS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype="bfloat16",
        page_size=PAGE,
        tokenizer_hash=tokenizer_hash({"a": 0, "b": 1, "c": 2}),
        model_id="smol-test",
    )
    args.update(overrides)
    return model_fingerprint(**args)


def record(n_tokens: int, seed: int, hits: int = 0, pinned: bool = False, dtype=torch.bfloat16) -> PrefixRecord:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(LAYERS, 2, n_tokens, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    return PrefixRecord([(seed * 7 + i) % 1000 for i in range(n_tokens)], kv, hits, pinned)


def manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def write_manifest(path: Path, m: dict) -> None:
    (path / "manifest.json").write_text(json.dumps(m))


def writer_process(root: str, writer: str, rounds: int, seed: int) -> None:
    """Entry point for a separate process that saves `rounds` snapshots into `root`."""
    from preheat.engine.kv.snapshot import save_snapshot

    for i in range(rounds):
        save_snapshot(root, fingerprint(), [record(8, seed + i, hits=i, pinned=True)], writer)
