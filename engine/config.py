"""Every engine setting in one dataclass, parsed from CLI flags and PREHEAT_* variables.

Each field's metadata carries its help text and flag name, so `preheat serve --help`,
the environment-variable names (`PREHEAT_<FIELD>`), and validation come from one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from preheat.engine.dtypes import MODEL_DTYPES
from preheat.engine.tools.parsers import FORMATS

DTYPES = ("auto", *MODEL_DTYPES)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's spellings; fp8 = fp8_e4m3
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
SPECULATIVE_METHODS = ("ngram",)
SPECULATIVE_GATES = ("auto", "always")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
TOOL_CALL_PARSERS = ("auto", *FORMATS)
QUANTIZATIONS = ("auto", "none", "int8")  # auto (= unset): a GGUF in its own blocks where the kernels read them
INT8_ACTIVATION_BITS = (16, 8)


def _opt(help: str, default: Any = None, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class ModelSettings:
    """What to serve and how to hold it: read by engine/assemble.py and engine/model/."""

    SECTION: ClassVar[str] = "model"

    model: str | None = _opt(
        "Model to serve: a Hugging Face directory (config + safetensors + tokenizer) or a "
        ".gguf file; a hub id ORG/NAME or hf://ORG/NAME[@REVISION][/FILE.gguf] (HF_ENDPOINT, "
        "HF_TOKEN); s3://BUCKET/PREFIX (AWS_ENDPOINT_URL, the standard credential chain). "
        "Remote models are downloaded once into --download-dir. Empty = the embedded default, "
        "SmolLM2-135M-Instruct.",
        aliases=("--model-path",),
    )
    download_dir: str | None = _opt(
        "Where hub and S3 models are downloaded (atomically, resumable, verified once, locked "
        "so processes sharing it download once). Empty = HF_HUB_CACHE when set, else "
        "<weight cache>/downloads."
    )
    model_peer_url: str | None = _opt(
        "Base URL of a peer engine of the same service (the headless Service of the serving "
        "pods) to fetch a hub or S3 model's files from before asking the source; each file "
        "is checked against the digests the source lists, and the source is used when no "
        "peer answers or a file does not verify. Needs --peer-secret-file (the bearer token)."
    )
    model_peer_timeout: float = _opt(
        "Seconds the whole fetch from --model-peer-url may take before the source is used.",
        900.0,
        min=0.0,
    )
    served_model_name: str | None = _opt(
        "Name clients use in the `model` field (default: derived from --model)."
    )
    dtype: str = _opt("Weight and activation dtype.", "auto", choices=DTYPES)
    device: str = _opt("Device: auto, cpu or cuda[:N].", "auto")
    max_model_len: int | None = _opt(
        "Longest prompt + completion in tokens (default: the model's context length).",
        aliases=("--context-length",),
    )
    weight_cache_dir: str | None = _opt(
        "Directory for converted weights (safetensors), keyed by source hash and dtype; "
        "makes every load after the first a memory-mapped read. Empty = ~/.cache/preheat/weights; "
        "'off' disables it."
    )
    seed: int = _opt("Seed for requests that give none.", 0)
    tensor_parallel_size: int = _opt(
        "Shard the model over this many ranks (Megatron-style tensor parallelism, one process "
        "per rank: NCCL across GPUs cuda:0..N-1, gloo on CPU). Must divide the attention heads "
        "and the MLP width; KV heads are split, or replicated when fewer than the ranks.",
        1,
        min=1,
        aliases=("--tp-size",),
    )
    quantization: str | None = _opt(
        "Weight quantization. auto (the default; empty = auto): a GGUF whose matrices are "
        "block-quantized is served in its own blocks, as llama.cpp serves it (Q4_0/Q4_1/Q4_K kept "
        "at 4 bits, Q8_0 at 8, other types in int8), where the CPU kernels read them in place "
        "(a CPU with them, --dtype bfloat16 or float32); anything else is served unquantized. "
        "none: dequantize to --dtype. int8: every matrix as int8 blocks of 32 (a GGUF's own "
        "blocks as above), about half the bytes a decode step reads in bfloat16. Activations "
        "and the KV cache keep --dtype.",
        None,
        choices=QUANTIZATIONS,
    )
    int8_activation_bits: int = _opt(
        "Width of the activation codes inside an int8 / 4-bit matrix multiply on the CPU "
        "kernels. 16 (the default): int16 per block of 32, far below bfloat16's own rounding. "
        "8: int8 per block of 32, as llama.cpp quantizes activations against its 4-bit blocks; "
        "its matrix multiplies take ~0.75-0.85x the time at 8+ rows (prompts, batches) and it "
        "costs accuracy (benchmarks/results/int8_accuracy.md). Needs the AVX-512 VNNI build; "
        "the AVX2 build runs 16.",
        16,
        choices=INT8_ACTIVATION_BITS,
    )


@dataclass
class CacheSettings:
    """The KV pool, the prefix cache and the L2/L3 tiers: read by engine/assemble.py and engine/kv/."""

    SECTION: ClassVar[str] = "KV cache"

    page_size: int = _opt("Tokens per KV page.", 16, min=1, max=1024)
    mem_fraction_static: float | None = _opt(
        "Fraction of free device memory for the KV pool (default 0.85 on GPU, 0.10 of "
        "available RAM on CPU: the node's MemAvailable, at most what the container's "
        "memory limit leaves).",
        None,
        min_excl=0.0,
        max=1.0,
    )
    max_total_tokens: int | None = _opt(
        "Cap on KV pool size in tokens (overrides the memory fraction when smaller)."
    )
    kv_cache_dtype: str = _opt(
        "KV cache dtype: auto (= model dtype), fp8 (= fp8_e4m3) or fp8_e5m2 (CPU; CUDA: e4m3): "
        "8-bit pages with per-layer K and V scales calibrated at start-up, about twice the "
        "tokens in the same memory.",
        "auto",
        choices=KV_CACHE_DTYPES,
    )
    disable_radix_cache: bool = _opt("Turn the radix prefix cache off.", False)
    kv_prefault_mib: float = _opt(
        "MiB of a CPU KV pool's first pages given memory in the background, by a thread at "
        "idle priority, before prompts write them: a fresh replica's first prompts then do "
        "not fault on every page of K and V (0 = off).",
        256.0,
        min=0.0,
    )

    # L2/L3 tiers below the pool
    host_cache_size: float = _opt(
        "GiB of host memory for the L2 KV tier (0 = off).", 0.0, min=0.0
    )
    disk_cache_dir: str | None = _opt("Directory for the L3 KV tier (empty = off).")
    prefetch_policy: str = _opt(
        "How a match that reaches L2/L3 pages waits for them.",
        "best_effort",
        choices=PREFETCH_POLICIES,
        aliases=("--hicache-storage-prefetch-policy",),
    )
    prefetch_timeout_ms: float = _opt(
        "Deadline for the 'timeout' prefetch policy.", 50.0, min=0.0
    )

    @property
    def enable_prefix_caching(self) -> bool:
        return not self.disable_radix_cache


@dataclass
class SchedulerSettings:
    """What runs each step: read by engine/sched/scheduler.py."""

    SECTION: ClassVar[str] = "scheduler"

    max_num_seqs: int = _opt("Most requests running at once.", 64, min=1, aliases=("--max-running-requests",))
    max_queue_len: int = _opt(
        "Most requests waiting to start (each choice of each prompt counts); a request that "
        "would exceed it is answered 429 with Retry-After.",
        1024,
        min=1,
    )
    chunked_prefill_size: int | None = _opt(
        "Most prompt tokens computed in one step; longer prompts are split so running "
        "decodes are not stalled (default: 512 on CPU; on a GPU 2048, or 8192 with 40 GiB "
        "or more).",
        None,
        min=1,
    )


@dataclass
class SpeculativeSettings:
    """Drafts: read by engine/sched/speculation.py."""

    SECTION: ClassVar[str] = "speculative decoding"

    speculative_method: str | None = _opt(
        "Speculative decoding: 'ngram' drafts the next tokens by prompt lookup (the tokens that "
        "followed the last n tokens' latest earlier occurrence in prompt + output) and verifies "
        "them in one batched forward. Empty = off.",
        None,
        choices=SPECULATIVE_METHODS,
    )
    num_speculative_tokens: int = _opt(
        "Most draft tokens proposed per sequence and step (with --speculative-method).", 4, min=1, max=64
    )
    # At most 64: each step compares the last n tokens with every window of a sequence's
    # context for each n from max down to min, so an unbounded n would stall every step.
    prompt_lookup_max: int = _opt(
        "Longest n-gram (the last n tokens) the ngram drafter looks up; longer matches are tried first.",
        4,
        min=1,
        max=64,
    )
    prompt_lookup_min: int = _opt("Shortest n-gram the ngram drafter looks up.", 2, min=1, max=64)
    speculative_gate: str = _opt(
        "When drafts are verified (with --speculative-method): 'auto' only where they are expected "
        "to pay, from each request's recent acceptance and the measured cost of a draft token at "
        "the running batch size (so a large batch of text that does not repeat decodes plainly); "
        "'always' on every n-gram match.",
        "auto",
        choices=SPECULATIVE_GATES,
    )


@dataclass
class RequestSettings:
    """Bounds and formats of one request: read by engine/request/ and engine/sample/."""

    SECTION: ClassVar[str] = "requests"

    tool_call_parser: str = _opt(
        "Format the model writes tool calls in (parsed out of its answers, and enforced by a "
        "grammar): hermes (<tool_call> JSON; Hermes, Qwen) or llama3_json (Llama 3.x JSON). "
        "auto: the one the chat template shows, else hermes.",
        "auto",
        choices=TOOL_CALL_PARSERS,
    )
    max_request_prompt_tokens: int = _opt(
        "Most prompt tokens one request may bring, summed over its prompts and choices "
        "(prompts x n); more is a 400.",
        262144,
        min=1,
    )
    grammar_compile_timeout: float = _opt(
        "Seconds a regex or JSON schema may take to compile; a longer compile is stopped "
        "and the request answered 400.",
        10.0,
        min_excl=0.0,
    )



@dataclass
class GPUSettings:
    """CUDA graphs: read by engine/runner.py."""

    SECTION: ClassVar[str] = "GPU path"

    cuda_graph_max_bs: int = _opt("Largest decode batch captured as a CUDA graph.", 32, min=1)
    disable_cuda_graph: bool = _opt("Decode eagerly even on CUDA.", False)


@dataclass
class ServerSettings:
    """The HTTP process: read by engine/serve/."""

    SECTION: ClassVar[str] = "server"

    host: str = _opt("Address to bind.", "0.0.0.0")
    port: int = _opt("Port to bind.", 8000, min=1, max=65535)
    api_key: str | None = _opt(
        "If set, requests must send `Authorization: Bearer <key>`. An empty value is an error "
        "(it would otherwise turn authentication off unnoticed)."
    )
    peer_secret_file: str | None = _opt(
        "The service's peer secret: a file (one key per line, the first current) or a Secret "
        "volume directory (`current`, plus e.g. `previous` during a rotation). /admin/* answers "
        "only it (never --api-key; without it /admin/* is off, 404), snapshots are signed with "
        "it, and only snapshots that verify are restored. Unset: a standalone engine that "
        "trusts its own --snapshot-dir."
    )
    trusted_hosts: str | None = _opt(
        "Comma-separated Host names answered (e.g. `preheat.example.com,*.svc.cluster.local`); "
        "others get 400 (DNS rebinding). Probes and /metrics are exempt. Empty = any."
    )
    limit_concurrency: int | None = _opt(
        "Most requests in flight at once before 503 (probes and /metrics exempt). Default: "
        "max-num-seqs + max-queue-len + 64, so a full queue's 429 is what load sees.",
        None,
        min=1,
    )
    http_header_timeout: float = _opt(
        "Seconds a client may take to send a request's line and headers (slowloris).", 10.0,
        min_excl=0.0,
    )
    http_body_timeout: float = _opt(
        "Seconds a client may take to send a request's body before 408.", 30.0, min_excl=0.0
    )
    log_level: str = _opt("Log level.", "info", choices=LOG_LEVELS)
    shutdown_timeout: float = _opt(
        "Seconds to let in-flight requests finish after SIGTERM.", 25.0, min=0.0
    )
    max_request_body_bytes: int = _opt("Largest accepted request body.", 4 * 1024 * 1024, min=1)

    @property
    def trusted_host_list(self) -> list[str]:
        return [h.strip() for h in (self.trusted_hosts or "").split(",") if h.strip()]


@dataclass
class WarmStartSettings:
    """Warmup and snapshots: read by engine/warm/."""

    SECTION: ClassVar[str] = "warm start"

    warmup_templates: str | None = _opt(
        "Directory of warmup template YAML files to run before /ready turns 200."
    )
    skip_server_warmup: bool = _opt(
        "Skip the built-in warmup (every captured CUDA-graph batch size, the prefill chunk "
        "sizes, one JSON-schema and one tool-call grammar, sampling with and without "
        "penalties) that runs before /ready; templates given with --warmup-templates still "
        "run. SGLang's flag.",
        False,
    )
    warmup_steps: int = _opt(
        "Decode steps (max_tokens) of each warmup request: the built-in warmup's, and a "
        "template's that sets no max_tokens.",
        4,
        min=1,
        max=1024,
    )
    snapshot_dir: str | None = _opt(
        "Directory (shared by the service's pods) for hot-prefix KV snapshots."
    )
    snapshot_interval: float = _opt(
        "Seconds between periodic snapshots (0 = only on demand and at shutdown).", 300.0, min=0.0
    )
    snapshot_max_tokens: int = _opt("Most tokens of KV written into one snapshot.", 65536, min=0)
    snapshot_max_bytes: int | None = _opt(
        "Bytes --snapshot-dir may hold: pruning deletes the oldest snapshots beyond it (the "
        "newest always stays). Default: what its volume holds with a tenth kept free. Set it "
        "for an emptyDir (its sizeLimit is not what statvfs sees).",
        None,
        min=1,
    )
    snapshot_restore_candidates: int = _opt(
        "Most snapshots one restore reads (newest first) before warming cold: each refused one "
        "costs a read, and a volume others can write may hold many.",
        4,
        min=1,
    )
    snapshot_peer_url: str | None = _opt(
        "Base URL of a peer engine (normally the headless Service of the serving pods) to "
        "fetch the newest snapshot from before restoring; needs --peer-secret-file (sent as "
        "the bearer token)."
    )
    snapshot_peer_timeout: float = _opt(
        "Seconds the fetch from --snapshot-peer-url may take.", 60.0, min=0.0
    )
    shutdown_snapshot_timeout: float | None = _opt(
        "Seconds the snapshot at shutdown may take: its size is chosen to fit (default: no "
        "limit). The operator sets it to what the grace period leaves after draining.",
        None,
        min=0.0,
    )


@dataclass
class EngineConfig(
    WarmStartSettings, ServerSettings, GPUSettings, RequestSettings, SpeculativeSettings, SchedulerSettings,
    CacheSettings, ModelSettings,
):
    """Every engine setting: the sections above, flat. Flags, `PREHEAT_<FIELD>` variables and
    `LLM(**kwargs)` use the flat names; each part of the engine is handed (and typed as) the
    section it reads."""

    def __post_init__(self) -> None:
        validate(self)

    @property
    def request_limit(self) -> int:
        """--limit-concurrency, or its default: above what the scheduler queues."""
        if self.limit_concurrency is not None:
            return self.limit_concurrency
        return self.max_num_seqs + self.max_queue_len + 64


SECTIONS: tuple[type, ...] = (
    ModelSettings, CacheSettings, SchedulerSettings, SpeculativeSettings, RequestSettings, GPUSettings,
    ServerSettings, WarmStartSettings,
)


class ConfigError(ValueError):
    """A setting has a value the engine cannot run with; the message is one line."""


def default_chunked_prefill_size(device_type: str, device_memory_bytes: int) -> int:
    """A step's prompt-token budget when none is given. On CPU a 512-token step already
    takes ~0.3 s for a 135M model, the longest pause running decodes should see; a GPU runs
    thousands of tokens in milliseconds, and bigger chunks keep its matmuls efficient, as
    far as memory for their activations allows (SGLang sizes its default the same way)."""
    if device_type != "cuda":
        return 512
    return 8192 if device_memory_bytes >= 40 * 2**30 else 2048


def validate(cfg: EngineConfig) -> None:
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if value is None:
            continue
        meta = f.metadata
        flag = "--" + f.name.replace("_", "-")
        if "choices" in meta and value not in meta["choices"]:
            raise ConfigError(f"{flag}: {value!r} is not one of {', '.join(map(str, meta['choices']))}")
        if "min" in meta and value < meta["min"]:
            raise ConfigError(f"{flag}: {value} is below the minimum {meta['min']}")
        if "min_excl" in meta and value <= meta["min_excl"]:
            raise ConfigError(f"{flag}: {value} must be greater than {meta['min_excl']}")
        if "max" in meta and value > meta["max"]:
            raise ConfigError(f"{flag}: {value} is above the maximum {meta['max']}")
    if cfg.api_key is not None and not cfg.api_key.strip():
        raise ConfigError("--api-key: the key is empty; give a key, or leave the flag and PREHEAT_API_KEY unset")
    from preheat.engine.model.uri import ModelURIError, parse_model

    try:
        parse_model(cfg.model)
    except ModelURIError as e:
        raise ConfigError(str(e)) from None
    if cfg.peer_secret_file is not None and not cfg.peer_secret_file.strip():
        raise ConfigError("--peer-secret-file: the path is empty; give a path, or leave the flag "
                          "and PREHEAT_PEER_SECRET_FILE unset")
    if cfg.prompt_lookup_min > cfg.prompt_lookup_max:
        raise ConfigError("--prompt-lookup-min must not exceed --prompt-lookup-max")
    if cfg.max_total_tokens is not None and cfg.max_total_tokens < cfg.page_size:
        raise ConfigError("--max-total-tokens must hold at least one page")


# Optional settings where an empty value is a mistake to report rather than "unset": an empty
# API key must not switch authentication off.
_EMPTY_IS_AN_ERROR = {"api_key", "peer_secret_file"}


def _field_type(f: dataclasses.Field) -> type:
    t = str(f.type)
    if "bool" in t:
        return bool
    if "int" in t:
        return int
    if "float" in t:
        return float
    return str


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds one flag per field, grouped by section in `--help`; defaults come from
    PREHEAT_<FIELD> when set."""
    for section in SECTIONS:
        group = parser.add_argument_group(section.SECTION)
        for f in dataclasses.fields(section):
            _add_flag(group, f)


def _add_flag(parser: Any, f: dataclasses.Field) -> None:
    kind = _field_type(f)
    flag = "--" + f.name.replace("_", "-")
    env = "PREHEAT_" + f.name.upper()
    help_text = f"{f.metadata.get('help', '')} [env {env}]"
    # SGLang's names for the flags its users type first (docs/coming-from-sglang.md).
    names = [flag, *f.metadata.get("aliases", ())]
    if kind is bool:
        parser.add_argument(*names, dest=f.name, action="store_true", default=None, help=help_text)
    else:
        default = f.default
        shown = "" if default is None else f" (default: {default})"
        parser.add_argument(
            *names, dest=f.name, type=str, default=None, help=help_text + shown, metavar=f.name.upper()
        )


def from_namespace(ns: argparse.Namespace, environ: dict[str, str] | None = None) -> EngineConfig:
    """Builds the config: a flag wins over PREHEAT_<FIELD>, which wins over the default."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f in dataclasses.fields(EngineConfig):
        kind = _field_type(f)
        flag = "--" + f.name.replace("_", "-")
        env = "PREHEAT_" + f.name.upper()
        raw = getattr(ns, f.name, None)
        source = flag
        if raw is None and env in environ:
            raw, source = environ[env], env
        if raw is None:
            continue
        try:
            if kind is bool:
                values[f.name] = raw if isinstance(raw, bool) else _parse_bool(raw)
            elif raw == "" and f.default is None and f.name not in _EMPTY_IS_AN_ERROR:
                values[f.name] = None
            else:
                values[f.name] = kind(raw)
        except ValueError:
            raise ConfigError(f"{source}: {raw!r} is not a valid {kind.__name__}") from None
    return EngineConfig(**values)


def parse_args(argv: Sequence[str] | None = None, prog: str = "preheat serve") -> EngineConfig:
    parser = argparse.ArgumentParser(
        prog=prog, description="Serve a language model with an OpenAI-compatible API."
    )
    add_arguments(parser)
    return from_namespace(parser.parse_args(argv))
