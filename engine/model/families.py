"""The model families the engine runs, and the decisions about which checkpoints it accepts.

One table says, per Hugging Face `model_type`, what the forward pass must do differently
(per-head q/k norm, q/k/v bias, which mixture-of-experts router). Everything that asks
"is this model supported?" — the config reader, the GGUF check before a slow conversion,
`preheat serve`'s start-up check — asks this table, so the error message always lists the
same families.
"""

from __future__ import annotations

from dataclasses import dataclass


class UnsupportedModelError(ValueError):
    """A checkpoint of a family (or format) the engine does not run; the message says which
    families it does run."""


@dataclass(frozen=True)
class Family:
    model_type: str  # Hugging Face config.json `model_type`
    title: str  # what the README calls it
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3)
    qkv_bias: bool = False  # q/k/v projections always carry a bias (Qwen2)
    moe: str | None = None  # router kind for sparse layers: "qwen3_moe" or "mixtral"
    gguf: bool = True  # transformers can read this family from a GGUF file


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama", "Llama 2 / 3.x"),
        Family("mistral", "Mistral"),
        Family("qwen2", "Qwen2 / Qwen2.5", qkv_bias=True),
        Family("qwen3", "Qwen3 (dense)", qk_norm=True),
        Family("qwen3_moe", "Qwen3-MoE (e.g. Qwen3-30B-A3B)", qk_norm=True, moe="qwen3_moe"),
        # llama.cpp writes Mixtral as architecture "llama" with experts; transformers reads
        # that as a plain Llama and would leave the experts unloaded.
        Family("mixtral", "Mixtral", moe="mixtral", gguf=False),
    )
}


def supported_list() -> str:
    return ", ".join(sorted(FAMILIES))


def family_for(model_type: str | None) -> Family:
    """The family of a config's `model_type`; raises UnsupportedModelError naming the
    supported ones."""
    family = FAMILIES.get(str(model_type))
    if family is None:
        raise UnsupportedModelError(f"unsupported model type {model_type!r}; supported: {supported_list()}")
    return family


def gguf_model_type(architecture: str, model_name: str, expert_count: int) -> str:
    """The `model_type` transformers will make of a GGUF file (as its GGUF reader decides from
    `general.architecture` and `general.name`), refusing — before the slow conversion —
    what we do not run or what transformers cannot read whole.

    Pure: the caller reads the three metadata fields."""
    arch = architecture.lower()
    if arch == "llama" and expert_count > 0:
        raise UnsupportedModelError(
            f"this GGUF is a mixture-of-experts model stored as architecture 'llama' with {expert_count} "
            "experts (Mixtral-style); transformers cannot read its experts from GGUF. Use the Hugging Face "
            "safetensors checkpoint (model_type 'mixtral') instead"
        )
    renamed = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}.get(arch, arch)
    if renamed == "llama" and "mistral" in model_name.lower():
        renamed = "mistral"
    family = FAMILIES.get(renamed)
    if family is None:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {architecture!r}; supported model types: {supported_list()}"
        )
    if not family.gguf:
        raise UnsupportedModelError(
            f"transformers cannot read {family.model_type!r} from GGUF; use the Hugging Face safetensors checkpoint"
        )
    return renamed
