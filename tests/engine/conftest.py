"""Shared fixtures for engine tests: tiny random-weight models and the embedded model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from tiny_models import build_tiny_model

from preheat.engine.model.loader import DEFAULT_GGUF_NAME, DEFAULT_GGUF_PACKAGE


@pytest.fixture(scope="session")
def smollm_tokenizer():
    from transformers import AutoTokenizer

    folder = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE).submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file=DEFAULT_GGUF_NAME)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm_tokenizer) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", smollm_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, smollm_tokenizer) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", smollm_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory, smollm_tokenizer) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", smollm_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory, smollm_tokenizer) -> Path:
    """Sharded, as real MoE checkpoints are: model.safetensors.index.json plus shards."""
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-qwen3-moe"), "qwen3_moe", smollm_tokenizer, max_shard_size="2MB"
    )


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory, smollm_tokenizer) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-mixtral"), "mixtral", smollm_tokenizer)


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory, smollm_tokenizer) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-mistral"), "mistral", smollm_tokenizer)


# A 64-token vocabulary (special tokens, punctuation, digits, capitals of the SmolLM2
# tokenizer) makes a random model repeat itself, as speculative-decoding tests need.
SMALL_VOCAB = 64


@pytest.fixture(scope="session")
def small_vocab_llama_dir(tmp_path_factory, smollm_tokenizer) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-v64"), "llama", smollm_tokenizer, vocab_size=SMALL_VOCAB)


@pytest.fixture(scope="session")
def small_vocab_qwen2_dir(tmp_path_factory, smollm_tokenizer) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-v64"), "qwen2", smollm_tokenizer, vocab_size=SMALL_VOCAB)
