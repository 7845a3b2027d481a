"""The tokenizer and chat template stored in a GGUF file's metadata, built by transformers.

transformers already turns llama.cpp's vocabularies into fast tokenizers (GPT-2 style byte-level
BPE and SentencePiece/llama ones, with their control tokens, BOS/EOS and whether BOS is added)
and reads ``tokenizer.chat_template``; kvpilot uses that rather than a second implementation,
so prompts tokenize exactly as they do for a transformers model loaded from the same file.
"""

from __future__ import annotations

from pathlib import Path

from kvpilot.engine.models.errors import ModelLoadError
from kvpilot.engine.models.gguf_file import GGUFFile


def load_gguf_tokenizer(path: str | Path):
    """A transformers fast tokenizer built from the GGUF file's ``tokenizer.*`` metadata."""
    gguf_file = GGUFFile(path)  # clear errors for a missing, truncated or foreign file first
    gguf_file.require("tokenizer.ggml.model", str)
    gguf_file.require("tokenizer.ggml.tokens", list)
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(gguf_file.path.parent), gguf_file=gguf_file.path.name, local_files_only=True
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(
            f"{gguf_file.path}: cannot build the tokenizer from the GGUF metadata "
            f"(tokenizer.ggml.model = {gguf_file.get('tokenizer.ggml.model', str)!r}): {exc}"
        ) from exc
    if not getattr(tokenizer, "is_fast", False):
        raise ModelLoadError(f"{gguf_file.path}: transformers built a slow tokenizer; kvpilot needs a fast one")
    return tokenizer
