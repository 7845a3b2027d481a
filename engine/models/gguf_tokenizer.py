"""The tokenizer and chat template stored in a GGUF file's metadata, built by transformers.

transformers already turns llama.cpp's vocabularies into fast tokenizers (GPT-2 style byte-level
BPE and SentencePiece/llama ones, with their control tokens, BOS/EOS and whether BOS is added)
and reads ``tokenizer.chat_template``; kvpilot uses that rather than a second implementation,
so prompts tokenize exactly as they do for a transformers model loaded from the same file.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from kvpilot.engine.models.errors import ModelLoadError
from kvpilot.engine.models.gguf_file import GGUFFile


def load_gguf_tokenizer(path: str | Path):
    """A transformers fast tokenizer built from the GGUF file's ``tokenizer.*`` metadata."""
    path = Path(path)
    if not path.is_file():
        GGUFFile(path)  # raises the error that says what is wrong with the path
    try:
        tokenizer = _from_the_file_alone(path)
    except Exception as exc:  # transformers' GGUF reader raises anything on a bad file
        # Parsing the file is slow (seconds for a large vocabulary), so it is done only now, to say
        # which part of the file is at fault: truncation, a missing key, an unknown tokenizer type.
        gguf_file = GGUFFile(path)
        tokenizer_type = gguf_file.require("tokenizer.ggml.model", str)
        gguf_file.require("tokenizer.ggml.tokens", list)
        raise ModelLoadError(
            f"{path}: cannot build the tokenizer from the GGUF metadata (tokenizer.ggml.model = "
            f"{tokenizer_type!r}): {type(exc).__name__}: {exc}"
        ) from exc
    if not getattr(tokenizer, "is_fast", False):
        raise ModelLoadError(f"{path}: transformers built a slow tokenizer; kvpilot needs a fast one")
    return tokenizer


def _from_the_file_alone(path: Path):
    """transformers' tokenizer from the GGUF file, seeing no other file: given the file's own
    folder, AutoTokenizer would prefer a tokenizer.json or tokenizer_config.json lying beside it
    (a GGUF dropped into a Hugging Face folder would get that folder's tokenizer)."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="kvpilot-gguf-") as alone:
        os.symlink(path.resolve(), os.path.join(alone, path.name))
        return AutoTokenizer.from_pretrained(alone, gguf_file=path.name, local_files_only=True)
