"""Shared fixtures for engine tests: tiny random-weight models and the embedded model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from preheat.engine.model.loader import DEFAULT_GGUF_NAME, DEFAULT_GGUF_PACKAGE


@pytest.fixture(scope="session")
def smollm_tokenizer():
    from transformers import AutoTokenizer

    folder = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE).submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file=DEFAULT_GGUF_NAME)


def build_tiny_model(path: Path, arch: str, tokenizer, **overrides) -> Path:
    """Saves a random-weight model of the given family as a Hugging Face directory.
    A large initializer range makes logits peaked, so greedy decoding has clear winners."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.25,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=1,
    )
    common.update(overrides)
    torch.manual_seed(1234)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **common))
    else:
        raise ValueError(arch)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm_tokenizer) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", smollm_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, smollm_tokenizer) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", smollm_tokenizer)
