"""The tokenizer and chat template stored in a GGUF file's metadata, built by transformers.

transformers already turns llama.cpp's vocabularies into fast tokenizers (GPT-2 style byte-level
BPE and SentencePiece/llama ones, with their control tokens, BOS/EOS and whether BOS is added)
and reads ``tokenizer.chat_template``; kvpilot uses that rather than a second implementation,
so prompts tokenize exactly as they do for a transformers model loaded from the same file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from kvpilot.engine.checkpoint import ModelLoadError
from kvpilot.engine.model_fetch import cache_root
from kvpilot.engine.models.gguf_file import GGUFFile

logger = logging.getLogger(__name__)
TOKENIZER_CACHE_ENV = "KVPILOT_TOKENIZER_CACHE"  # default: $KVPILOT_CACHE/tokenizers
CACHED_TOKENIZERS = 16  # the newest this many files' tokenizers are kept


def load_gguf_tokenizer(path: str | Path):
    """A transformers fast tokenizer built from the GGUF file's ``tokenizer.*`` metadata.

    Building it takes most of a second (transformers converts the vocabulary); the result
    is saved in ``$KVPILOT_TOKENIZER_CACHE`` (default ``$KVPILOT_CACHE/tokenizers``), keyed by the
    file and the transformers version, so a later start of the same file loads it in a fraction of
    that."""
    path = Path(path)
    if not path.is_file():
        GGUFFile(path)  # raises the error that says what is wrong with the path
    cached = _cache_folder(path)
    if (cached / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(cached, local_files_only=True)
        except (OSError, ValueError) as exc:  # a cache entry cut short (a full disk): built again below
            logger.info("tokenizer cache %s unusable (%s); building from the GGUF file", cached, exc)
    gguf_file = GGUFFile(path)
    try:
        tokenizer = _from_the_file_alone(path, gguf_file.architecture)
    except Exception as exc:  # transformers' GGUF reader raises anything on a bad file
        # Say which part of the file is at fault: a missing key, an unknown tokenizer type.
        tokenizer_type = gguf_file.require("tokenizer.ggml.model", str)
        gguf_file.require("tokenizer.ggml.tokens", list)
        raise ModelLoadError(
            f"{path}: cannot build the tokenizer from the GGUF metadata (tokenizer.ggml.model = "
            f"{tokenizer_type!r}): {type(exc).__name__}: {exc}"
        ) from exc
    if not getattr(tokenizer, "is_fast", False):
        raise ModelLoadError(f"{path}: transformers built a slow tokenizer; kvpilot needs a fast one")
    _save(tokenizer, cached)
    return tokenizer


def _cache_folder(path: Path) -> Path:
    import transformers

    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{transformers.__version__}"
                         .encode()).hexdigest()[:16]
    root = Path(os.environ.get(TOKENIZER_CACHE_ENV) or cache_root() / "tokenizers")
    return root / f"{path.stem}-{key}"


def _save(tokenizer, folder: Path) -> None:
    """Saved under a temporary name and renamed: a concurrent start never reads half a folder. A cache
    that cannot be written (a read-only home) only costs the next start the build."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
        tokenizer.save_pretrained(staging)
        os.replace(staging, folder)
        for stale in sorted(folder.parent.iterdir(), key=lambda f: f.stat().st_mtime)[:-CACHED_TOKENIZERS]:
            shutil.rmtree(stale, ignore_errors=True)
    except OSError as exc:
        logger.info("tokenizer not cached in %s: %s", folder, exc)


def _from_the_file_alone(path: Path, architecture: str):
    """transformers' tokenizer from the GGUF file, seeing no other file: given the file's own
    folder, AutoTokenizer would prefer a tokenizer.json or tokenizer_config.json lying beside it
    (a GGUF dropped into a Hugging Face folder would get that folder's tokenizer)."""
    with tempfile.TemporaryDirectory(prefix="kvpilot-gguf-") as alone:
        os.symlink(path.resolve(), os.path.join(alone, path.name))
        return _tokenizer_class(architecture).from_pretrained(alone, gguf_file=path.name, local_files_only=True)


def _tokenizer_class(architecture: str):
    """The class AutoTokenizer gives a GGUF file of this ``general.architecture``, without its read of
    the file: to learn the model type, AutoTokenizer parses the whole header with the gguf package's
    reader (3-4 s of SmolLM2's build, for its 49k-token vocabulary, on 2 cores; the rest: under a second). A GGUF file
    names no tokenizer class, so AutoTokenizer takes the one transformers registers for the model
    type's config, else TokenizersBackend (llama, and mistral, which llama.cpp writes as "llama"),
    and TokenizersBackend for a MistralCommonBackend without Mistral's own files;
    tests/engine/test_gguf.py checks that this is the class and the tokenizer AutoTokenizer builds."""
    from transformers import AutoConfig, TokenizersBackend
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    chosen = TOKENIZER_MAPPING.get(type(AutoConfig.for_model(architecture)), TokenizersBackend)
    return TokenizersBackend if chosen.__name__ == "MistralCommonBackend" else chosen
