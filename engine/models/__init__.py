"""Llama-family models (Llama 2/3, Mistral, Qwen2) loaded from local Hugging Face folders or GGUF files."""

from kvpilot.engine.checkpoint import ModelLoadError, is_gguf_path
from kvpilot.engine.models.config import (
    SUPPORTED_ARCHITECTURES,
    ModelArch,
    RopeScaling,
    read_model_arch,
    saved_dtype,
)
from kvpilot.engine.models.llama import CausalLM
from kvpilot.engine.models.loader import SUPPORTED_DTYPES, load_model, load_tokenizer

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_DTYPES",
    "CausalLM",
    "ModelArch",
    "ModelLoadError",
    "RopeScaling",
    "is_gguf_path",
    "load_model",
    "load_tokenizer",
    "read_model_arch",
    "saved_dtype",
]
