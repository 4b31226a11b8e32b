"""Turns a checkpoint's tensors (transformers names) into our model's parts.

q/k/v and gate/up are concatenated so each is one matmul; experts are stacked into
[E, 2I, H] and [E, H, I] tensors for the grouped paths. Two naming schemes reach us for
experts: checkpoints on disk (one tensor per expert: Qwen3-MoE `mlp.experts.{e}.gate_proj`,
Mixtral `block_sparse_moe.experts.{e}.w1`) and transformers 5's in-memory layout, already
stacked (`mlp.experts.gate_up_proj`), which is what a GGUF conversion's state_dict — and so
the weight cache — holds.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from preheat.engine.kernels.backend import KernelBackend, choose_backend
from preheat.engine.kernels.int8 import QuantizedWeight
from preheat.engine.kernels.linear import LinearWeight
from preheat.engine.kernels.torch_backend import TorchBackend
from preheat.engine.model.decoder import DecoderLayer, DecoderModel, Reduce
from preheat.engine.model.layers import Attention, DenseMLP
from preheat.engine.model.moe import ExpertsFn, SparseMoE, grouped_experts_torch
from preheat.engine.model.rope import RotaryEmbedding, rope_inv_freq
from preheat.engine.model.sharding import Sharder, WholeWeights
from preheat.engine.model.spec import ModelSpec

log = logging.getLogger(__name__)

MOE_BACKEND_ENV = "PREHEAT_MOE_BACKEND"


def build_model(
    spec: ModelSpec, hf_config: Any, hf: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
    moe_backend: str = "torch", sharder: Sharder | None = None, reduce: Reduce | None = None,
    backend: KernelBackend | None = None, prepared: Mapping[str, LinearWeight] | None = None,
) -> DecoderModel:  # fmt: skip
    """The model on `device`. `backend` is the kernel backend every part runs on
    (engine/kernels/backend.py's select_backend; default the PyTorch reference): it decides
    the linear weights' form, so it is fixed here. `moe_backend` ("torch" or "triton", see
    choose_moe_backend) picks the experts implementation; it only matters for models with
    experts. A tensor-parallel rank passes its `sharder` (which slice of each weight it holds; sliced
    on the host, so only the slice reaches the device) and `reduce` (the all-reduce after
    o_proj and down_proj, engine/distributed/sharding.py). `prepared`: the matrices already in
    the backend's form, by engine/model/prepared_cache.py's names (a restart reads them from
    the weight cache); `hf`'s matrices are then never read."""
    experts_fn, graphs_off = _experts_impl(moe_backend) if spec.moe is not None else (grouped_experts_torch, None)
    shard = sharder or WholeWeights(spec)
    kernels = backend or TorchBackend()

    def get(name: str) -> torch.Tensor:
        return hf[name].to(device)

    def opt(name: str) -> torch.Tensor | None:
        return hf[name].to(device) if name in hf else None

    ready = prepared is not None
    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if prepared is not None:
            qkv, o = prepared[f"layers.{i}.attn.qkv"], prepared[f"layers.{i}.attn.o"]
        else:
            qkv = shard.qkv(hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"]).to(device)
            o = shard.o(hf[a + "o_proj.weight"]).to(device)
        qkv_bias = None
        if spec.qkv_bias and not ready:
            qkv_bias = shard.qkv(hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"]).to(device)
        attn = Attention(
            qkv, o, shard.heads.q_count, shard.heads.kv_count,
            spec.head_dim,
            qkv_bias=qkv_bias,
            o_bias=shard.reduced_bias(get(a + "o_proj.bias")) if spec.o_bias and not ready else None,
            q_norm=get(a + "q_norm.weight") if spec.qk_norm else None,
            k_norm=get(a + "k_norm.weight") if spec.qk_norm else None,
            norm_eps=spec.rms_norm_eps,
            dtype=dtype,
            backend=kernels,
        )  # fmt: skip
        if spec.is_sparse(i):
            mlp: DenseMLP | SparseMoE = _sparse_moe(spec, hf, p, device, experts_fn, shard)
        elif prepared is not None:  # biases are part of a prepared matrix
            mlp = DenseMLP(prepared[f"layers.{i}.mlp.gate_up"], prepared[f"layers.{i}.mlp.down"], dtype=dtype,
                           backend=kernels)  # fmt: skip
        else:
            m = p + "mlp."
            mlp = DenseMLP(
                shard.gate_up(hf[m + "gate_proj.weight"], hf[m + "up_proj.weight"]).to(device),
                shard.down(hf[m + "down_proj.weight"]).to(device),
                shard.gate_up(hf[m + "gate_proj.bias"], hf[m + "up_proj.bias"]).to(device) if spec.mlp_bias else None,
                shard.reduced_bias(get(m + "down_proj.bias")) if spec.mlp_bias else None,
                dtype=dtype,
                backend=kernels,
            )
        layers.append(
            DecoderLayer(get(p + "input_layernorm.weight"), attn, get(p + "post_attention_layernorm.weight"), mlp,
                         spec.rms_norm_eps, reduce, kernels)
        )  # fmt: skip
    embed = get("model.embed_tokens.weight")
    # A quantized LM head arrives as "lm_head.weight" even when tied (engine/model/quantize.py):
    # the embedding lookup keeps the unquantized tensor.
    if prepared is not None:
        lm_head: torch.Tensor | QuantizedWeight | LinearWeight = prepared["lm_head"]
    else:
        head = hf.get("lm_head.weight")
        lm_head = embed if spec.tie_word_embeddings and not isinstance(head, QuantizedWeight) else get("lm_head.weight")
    inv_freq, scaling = rope_inv_freq(hf_config, spec.head_dim)
    rope = RotaryEmbedding(inv_freq.to(device), scaling, dtype)
    return DecoderModel(spec, embed, layers, get("model.norm.weight"), lm_head, rope, graphs_off, kernels)


def _sparse_moe(spec: ModelSpec, hf: dict[str, torch.Tensor], prefix: str, device: torch.device,
                experts_fn: ExpertsFn, shard: Sharder) -> SparseMoE:  # fmt: skip
    moe = spec.moe
    assert moe is not None
    router_name, w13, w2 = expert_tensors(hf, prefix, moe.num_experts, moe.intermediate_size, spec.hidden_size)
    w13, w2 = shard.experts(w13, w2)
    return SparseMoE(hf[router_name].to(device), w13.to(device), w2.to(device), moe.top_k, moe.renormalize,
                     experts_fn)  # fmt: skip


def expert_tensors(
    hf: dict[str, torch.Tensor], prefix: str, num_experts: int, intermediate: int, hidden: int
) -> tuple[str, torch.Tensor, torch.Tensor]:
    """(router tensor name, w13 [E, 2I, H], w2 [E, H, I]) of one layer, from any of the
    naming schemes (see the module docstring)."""
    stacked = prefix + "mlp.experts.gate_up_proj"
    if stacked in hf:  # transformers 5 in-memory layout
        w13, w2 = hf[stacked], hf[prefix + "mlp.experts.down_proj"]
        if tuple(w13.shape) != (num_experts, 2 * intermediate, hidden) or tuple(w2.shape) != (
            num_experts, hidden, intermediate
        ):  # fmt: skip
            raise ValueError(f"{prefix}mlp.experts: unexpected shapes {tuple(w13.shape)} / {tuple(w2.shape)}")
        return prefix + "mlp.gate.weight", w13, w2
    if prefix + "mlp.experts.0.gate_proj.weight" in hf:  # Qwen3-MoE checkpoint
        e = prefix + "mlp.experts.{}."
        names = ("gate_proj", "up_proj", "down_proj")
        router = prefix + "mlp.gate.weight"
    elif prefix + "block_sparse_moe.experts.0.w1.weight" in hf:  # Mixtral checkpoint
        e = prefix + "block_sparse_moe.experts.{}."
        names = ("w1", "w3", "w2")
        router = prefix + "block_sparse_moe.gate.weight"
    else:
        raise KeyError(f"{prefix}: no expert weights found (looked for Qwen3-MoE, Mixtral and stacked names)")
    gate, up, down = names
    w13 = torch.stack(
        [torch.cat([hf[e.format(x) + gate + ".weight"], hf[e.format(x) + up + ".weight"]]) for x in range(num_experts)]
    )
    w2 = torch.stack([hf[e.format(x) + down + ".weight"] for x in range(num_experts)])
    return router, w13, w2


def choose_moe_backend(device: torch.device, override: str | None, triton_importable: bool,
                       interpreting: bool) -> tuple[str, str]:  # fmt: skip
    """("torch" | "triton", why) for the experts, decided like the attention backend: Triton
    on CUDA when importable; `PREHEAT_MOE_BACKEND=torch|triton` overrides."""
    return choose_backend(torch.device(device).type, triton_importable, override, interpreting, MOE_BACKEND_ENV)


def select_moe_backend(device: torch.device) -> str:
    """The experts backend for this process (environment and installed packages); logged."""
    import importlib.util
    import os

    name, why = choose_moe_backend(
        device,
        os.environ.get(MOE_BACKEND_ENV) or None,
        importlib.util.find_spec("triton") is not None,
        os.environ.get("TRITON_INTERPRET") == "1",
    )
    log.info("moe experts backend: %s (%s)", name, why)
    return name


def _experts_impl(backend: str) -> tuple[ExpertsFn, str | None]:
    if backend == "triton":
        try:
            from preheat.engine.kernels.triton_moe import fused_experts

            return fused_experts, None
        except Exception as exc:  # a missing or broken Triton must not stop serving
            log.warning("Triton MoE kernel unavailable (%s); using the torch experts path", exc)
    return grouped_experts_torch, "experts run on the torch path (it syncs with the host each layer)"
