"""What the model loaders (engine/models/) and the quantized formats (engine/quantization/) both
know about a checkpoint on disk: which kind a path names, and the one error a load raises.

It sits below both packages so that imports go one way: models -> quantization -> here.
"""

from __future__ import annotations

from pathlib import Path

GGUF_MAGIC = b"GGUF"


class ModelLoadError(ValueError):
    """A model folder cannot be loaded; the message says which file or field and what to do."""


def is_gguf_path(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file: a ``.gguf`` name, or any file starting with the GGUF magic."""
    path = Path(path)
    if path.suffix.lower() == ".gguf":
        return True
    if not path.is_file():
        return False
    with path.open("rb") as handle:
        return handle.read(len(GGUF_MAGIC)) == GGUF_MAGIC
