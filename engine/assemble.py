"""Everything an Engine is made of, built once from its config: the model, the KV pool sized to
the device, the prefix cache and tiers, the grammar backend, the runner with its CUDA graphs
and the request builder.

The order matters and is the one a reader can follow top to bottom in `assemble`: the
tensor-parallel workers start first (their start-up overlaps the load), the kernel backend
is chosen before the model is built (it decides the weights' form: packed for the CPU
kernels, plain tensors elsewhere), the pool is sized after the model is in memory (what is
left is what the KV may use), fp8 KV scales are calibrated on the built model, and CUDA
graphs are captured last, over the real pool.

What only the tokenizer decides (its hash for snapshot fingerprints, the grammar backend's
tokenizer info and compiler process) is built in a thread beside the model build: it is
Python holding the GIL, the weights' packing is torch copies that release it, so on two
cores the two overlap (`tokenizer_parts`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from preheat.engine.config import ConfigError, EngineConfig, default_chunked_prefill_size
from preheat.engine.distributed.comm import all_reduce
from preheat.engine.distributed.driver import DrivenModel
from preheat.engine.distributed.launcher import TensorParallel
from preheat.engine.dtypes import torch_dtype
from preheat.engine.kernels.backend import CpuKernelBackend, KernelBackend, select_backend
from preheat.engine.kv.cache_manager import KVCacheManager
from preheat.engine.kv.pool import KVPool, available_memory_bytes, pool_pages
from preheat.engine.kv.radix import RadixCache
from preheat.engine.kv.snapshot import model_fingerprint, tokenizer_hash
from preheat.engine.kv.tiers import KVTiers
from preheat.engine.model import prepared_cache, tokenizer_facts
from preheat.engine.model.build import build_model, select_moe_backend
from preheat.engine.model.loader import cache_root_of, load_model
from preheat.engine.model.locations import default_model_path
from preheat.engine.model.quantize import effective_quantization, quantize_weights
from preheat.engine.model.spec import ModelSpec
from preheat.engine.request.builder import RequestBuilder, default_stop_ids
from preheat.engine.runner import ModelRunner, run_prompt

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return torch_dtype(name)
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def fetched_config(config: EngineConfig) -> EngineConfig:
    """The config with a hub or S3 --model replaced by its local copy (downloaded now when
    missing). `preheat serve` has already done this in its downloading phase (a no-op
    then); the Python API (`LLM(model="org/name")`) gets it here."""
    from preheat.engine.model.download import Progress
    from preheat.engine.model.fetch import fetch_model, needs_download

    if not needs_download(config.model):
        return config
    fetched = fetch_model(config.model, config.download_dir, config.weight_cache_dir, Progress())
    return dataclasses.replace(config, model=fetched.path,
                               served_model_name=config.served_model_name or fetched.served_name)


@dataclass
class LoadedModel:
    """The built model and what was learnt loading it."""

    model: Any  # DecoderModel, or DrivenModel around it under tensor parallelism
    hf_config: Any
    spec: ModelSpec
    tokenizer: Any
    served_model_name: str
    weights_id: str
    weights_from_cache: bool
    hf_dir: str | None  # lets benchmarks and tests load the same weights in transformers
    attention_backend: str
    load_seconds: float
    kernels: KernelBackend  # the kernel backend object the model was built with
    prepared_dir: str | None = None  # the weight-cache entry of its prepared matrices, if kept


@dataclass
class EngineParts:
    device: torch.device
    dtype: torch.dtype
    tp: TensorParallel | None
    loaded: LoadedModel
    max_model_len: int
    kv_dtype: torch.dtype
    chunked_prefill_size: int
    pool: KVPool
    fingerprint: dict[str, Any]
    kv: KVCacheManager
    grammar_backend: Any
    runner: ModelRunner
    cuda_graph_capture_seconds: float
    cuda_graph_batch_sizes: list[int]
    requests: RequestBuilder
    quantization: str | None  # what runs: "int8" or None (--quantization auto resolved)


def assemble(config: EngineConfig) -> EngineParts:
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    # The kernel backend first: it decides the weights' form (packed for the CPU kernels,
    # plain tensors elsewhere) and whether a GGUF is served in its own blocks (auto).
    kernels = select_backend(device, config.int8_activation_bits)
    config = dataclasses.replace(config, quantization=effective_quantization(
        config.quantization, config.model or default_model_path(),
        kernels_read_blocks=kernels.name == "cpu" and dtype in (torch.bfloat16, torch.float32),
    ))
    # Tensor parallel: the workers start first (their start-up overlaps this load), read
    # the checkpoint themselves and build their shards (engine/distributed/).
    tp = TensorParallel.launch(config, device, dtype) if config.tensor_parallel_size > 1 else None
    try:
        return _assemble(config, device, dtype, tp, kernels)
    except BaseException:
        if tp is not None:
            tp.close()
        raise


@dataclass
class TokenizerParts:
    """What only the tokenizer decides, built beside the model (`beside`)."""

    tokenizer_hash: str
    grammar: tuple[Any, Any, Any]  # as `grammar` returns


def tokenizer_parts(tokenizer: Any, vocab_size: int, config: EngineConfig, model_dir: str | None = None,
                    cache_root: Path | None = None) -> TokenizerParts:
    """The tokenizer's hash and the grammar backend; what they derive from the tokenizer alone
    is read from (or, the first time, kept in) the weight cache when the tokenizer came from
    a model directory (engine/model/tokenizer_facts.py)."""
    where = (Path(model_dir), cache_root) if model_dir and cache_root is not None else None
    kept = tokenizer_facts.read(*where, vocab_size) if where else None
    th = kept.tokenizer_hash if kept else tokenizer_hash(
        tokenizer.get_vocab(),
        special_tokens={k: str(v) for k, v in tokenizer.special_tokens_map.items()},
        chat_template=getattr(tokenizer, "chat_template", None),
    )
    parts = grammar(tokenizer, vocab_size, config, kept.grammar_info if kept else None)
    if where and kept is None:
        tokenizer_facts.keep(*where, vocab_size, tokenizer_facts.TokenizerFacts(
            th, getattr(parts[0], "tokenizer_info_json", None)))
    return TokenizerParts(th, parts)


def beside(fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
    """fn(*args) on a daemon thread of its own (nothing waits for it at exit)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=run, name=f"beside-{fn.__name__}", daemon=True).start()
    return future


def _assemble(config: EngineConfig, device: torch.device, dtype: torch.dtype, tp: TensorParallel | None,
              kernels: KernelBackend) -> EngineParts:
    side: list[concurrent.futures.Future] = []
    loaded = load(config, device, dtype, tp, kernels, on_tokenizer=lambda tok, spec, model_dir: side.append(
        beside(tokenizer_parts, tok, spec.vocab_size, config, model_dir, cache_root_of(config.weight_cache_dir))))
    parts: TokenizerParts = side[0].result()
    spec = loaded.spec
    max_model_len = min(config.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)
    from preheat.engine.kernels.kv_fp8 import kv_storage_dtype

    try:
        kv_dtype = kv_storage_dtype(config.kv_cache_dtype, dtype, device)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    chunked_prefill_size = config.chunked_prefill_size or default_chunked_prefill_size(
        device.type, torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0,
    )
    pool = make_pool(config, spec, kv_dtype, device, tp)
    if pool.scales is not None and not tp:  # fp8 KV: per-layer scales, calibrated
        from preheat.engine.kv.fp8_calibration import calibrate_kv_scales

        prefill = functools.partial(run_prompt, loaded.model, device)
        pool.set_scales(calibrate_kv_scales(prefill, loaded.tokenizer, spec, device, dtype, kv_dtype,
                                            config.page_size))
    if tp:
        loaded.model = DrivenModel(loaded.model, tp)
    log.info(
        "kv pool: %d tokens in %d pages of %d, %.2f GiB; up to %d prompt tokens per step",
        pool.capacity_pages * config.page_size, pool.capacity_pages, config.page_size,
        pool.bytes / 2**30, chunked_prefill_size,
    )
    fingerprint = fingerprint_of(loaded, pool, kv_dtype, config.quantization, parts.tokenizer_hash)
    radix = RadixCache(pool) if config.enable_prefix_caching else None
    tiers = KVTiers.from_config(config) if radix is not None else None
    if tiers is not None:
        log.info(
            "kv tiers: L2 %.2f GiB host memory, L3 %s, prefetch %s",
            config.host_cache_size, config.disk_cache_dir or "off", config.prefetch_policy,
        )
    kv = KVCacheManager(pool, radix, tiers, fingerprint)
    grammar_backend, grammar_masks, draft_grammar_masks = parts.grammar
    runner = ModelRunner(loaded.model, pool, device, grammar_masks, draft_grammar_masks)
    graphs = runner.setup_graphs(
        min(config.cuda_graph_max_bs, config.max_num_seqs), max_model_len, config.disable_cuda_graph,
        loaded.attention_backend,
    )
    requests = RequestBuilder(
        loaded.tokenizer, spec.vocab_size, max_model_len, pool.capacity_pages, pool.page_size,
        default_stop_ids(loaded.tokenizer, loaded.hf_config), grammar_backend, device, config.seed,
        config.max_request_prompt_tokens,
    )
    return EngineParts(
        device, dtype, tp, loaded, max_model_len, kv_dtype, chunked_prefill_size, pool, fingerprint, kv,
        grammar_backend, runner, graphs.capture_seconds, list(graphs.batch_sizes), requests,
        config.quantization,
    )


def load(config: EngineConfig, device: torch.device, dtype: torch.dtype, tp: TensorParallel | None,
         kernels: KernelBackend, on_tokenizer: Callable[[Any, ModelSpec, str | None], None] | None = None,
         ) -> LoadedModel:  # fmt: skip
    """Reads the checkpoint and builds the model on `device` (this rank's shard under tensor
    parallelism, whose workers read their own). `on_tokenizer(tokenizer, spec, model_dir)` is called
    once the tokenizer is loaded, before the model is built."""
    started = time.monotonic()
    loaded = load_model(config.model, dtype, config.weight_cache_dir)
    if on_tokenizer is not None:
        on_tokenizer(loaded.tokenizer, loaded.spec, loaded.hf_dir)
    if tp is not None:
        tp.join(loaded)
    spec = loaded.spec
    moe_backend = select_moe_backend(device) if spec.moe is not None else "torch"
    # The matrices as the kernels read them, kept by an earlier start with these weights.
    cache_root = cache_root_of(config.weight_cache_dir)
    entry = None
    if cache_root is not None and isinstance(kernels, CpuKernelBackend) and tp is None and spec.moe is None:
        entry = prepared_cache.entry_path(cache_root, loaded.weights_id, dtype, config.quantization)
    prepared = (prepared_cache.read(entry, spec, dtype, kernels.kernels, kernels.dense_from_rows,
                                    kernels.int8_activation_bits) if entry else None)  # fmt: skip
    weights = loaded.weights
    if config.quantization and prepared is None:
        weights = quantize_weights(weights, spec, loaded.source, config.quantization)
    model = build_model(
        spec, loaded.hf_config, weights, device, dtype, moe_backend, backend=kernels, prepared=prepared,
        **({"sharder": tp.sharder(spec), "reduce": all_reduce} if tp else {}),
    )  # fmt: skip
    del weights  # the model holds what it needs; drop the checkpoint's own tensors
    if entry is not None and prepared is None:
        if not prepared_cache.write(entry, model, replace_unusable=(entry / prepared_cache.DONE).is_file()):
            entry = None
    result = LoadedModel(
        model, loaded.hf_config, spec, loaded.tokenizer, config.served_model_name or loaded.served_name,
        loaded.weights_id, loaded.from_cache, loaded.hf_dir, kernels.name, time.monotonic() - started, kernels,
        str(entry) if entry is not None else None,
    )
    del loaded
    log.info(
        "model: %s (%s, %d layers, %d heads / %d KV heads, head_dim %d) on %s in %s%s%s, kernels %s, "
        "loaded in %.1fs",
        result.served_model_name, spec.architecture, spec.num_layers, spec.num_heads,
        spec.num_kv_heads, spec.head_dim, device, str(dtype).removeprefix("torch."),
        f" with {config.quantization} weights" if config.quantization else "",
        f", tensor parallel over {tp.size} ranks" if tp else "", kernels.name, result.load_seconds,
    )
    return result


def make_pool(config: EngineConfig, spec: ModelSpec, kv_dtype: torch.dtype, device: torch.device,
              tp: TensorParallel | None) -> KVPool:
    """The KV pool, sized to what the device has left after the weights (--mem-fraction-static
    of it, at most --max-total-tokens), this rank's KV heads only."""
    fraction = config.mem_fraction_static or (0.85 if device.type == "cuda" else 0.10)
    kv_heads = tp.local_kv_heads(spec.num_kv_heads) if tp else spec.num_kv_heads
    if tp and device.type == "cpu":
        fraction /= tp.size  # every rank's pool comes out of the same host memory
    num_pages = pool_pages(
        spec.kv_bytes_per_token(kv_dtype) * kv_heads // spec.num_kv_heads,  # this rank's heads
        available_memory_bytes(device),
        fraction,
        config.page_size,
        config.max_total_tokens,
    )
    shape = (spec.num_layers, spec.num_kv_heads, spec.head_dim, num_pages, config.page_size, kv_dtype)
    if tp:
        return tp.make_pool(*shape)
    return KVPool(*shape, device, prefault_bytes=int(config.kv_prefault_mib * 2**20))


def fingerprint_of(loaded: LoadedModel, pool: KVPool, kv_dtype: torch.dtype, quantization: str | None,
                   tokenizer_digest: str) -> dict[str, Any]:
    """What a snapshot must match to be restored here (engine/kv/snapshot.py);
    `tokenizer_digest` is the tokenizer's `tokenizer_hash` (`tokenizer_parts`)."""
    spec = loaded.spec
    return model_fingerprint(
        architecture=spec.architecture,
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        dtype=kv_dtype,
        page_size=pool.page_size,
        tokenizer_hash=tokenizer_digest,
        model_id=loaded.weights_id,
        # Quantized weights give other KV; the field is absent otherwise, so snapshots
        # of unquantized engines keep their fingerprint.
        **({"quantization": quantization} if quantization else {}),
        # int8 activation codes change the KV as well (--int8-activation-bits 8); absent at 16.
        **({"int8_activation_bits": 8} if quantization and getattr(loaded.kernels, "int8_activation_bits", 16) == 8
           else {}),
        # fp8 KV: values were divided by these scales; other scales read them wrong.
        **({"kv_scales": pool.scales.flatten().tolist()} if pool.scales is not None else {}),
    )


def grammar(tokenizer: Any, vocab_size: int, config: EngineConfig,
            tokenizer_info_json: str | None = None) -> tuple[Any, Any, Any]:  # fmt: skip
    """(grammar backend, mask function, draft mask function); all None when xgrammar is not
    importable (structured output is optional for the core engine)."""
    try:
        from preheat.engine.sample import structured

        backend = structured.GrammarBackend(tokenizer, vocab_size, compile_timeout=config.grammar_compile_timeout,
                                            tokenizer_info_json=tokenizer_info_json)  # fmt: skip
    except ImportError as exc:
        log.warning("structured output unavailable: %s", exc)
        return None, None, None
    return backend, structured.apply_grammar_masks, structured.apply_draft_grammar_masks
