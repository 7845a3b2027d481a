"""The one error a model folder can raise at load time."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model folder cannot be loaded; the message says which file or field and what to do."""
