"""One GGUF file (llama.cpp's single-file checkpoint), opened with the `gguf` package.

The file is memory-mapped: opening it reads the header, metadata and tensor directory, never the
weights. Every way a file can be unusable becomes a ModelLoadError that names the file and what
is wrong with it (the key, or the tensor and its type), because the gguf reader itself raises
bare ValueErrors ("cannot reshape array of size ...") that do not say which tensor is at fault.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpilot.engine.models.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
# The GGML tensor types kvpilot dequantizes (with the gguf package's dequantizers): the float
# types, llama.cpp's legacy block quantizations, and the two k-quants of the common Q4_K_M files.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K")
_REPAIR_HINT = "re-download the file, or re-convert the model with llama.cpp's convert_hf_to_gguf.py"


def is_gguf_path(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file: a ``.gguf`` name, or any file starting with the GGUF magic."""
    path = Path(path)
    if path.suffix.lower() == ".gguf":
        return True
    if not path.is_file():
        return False
    with path.open("rb") as handle:
        return handle.read(len(GGUF_MAGIC)) == GGUF_MAGIC


class GGUFFile:
    """Metadata and tensor directory of a GGUF file; tensors are memory-mapped numpy arrays.

    ``tensors`` maps each name to a ``gguf.ReaderTensor`` (``tensor_type``, ``shape`` in GGML
    order, i.e. innermost dimension first, and ``data``, the raw bytes or values).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(
                f"GGUF file {str(self.path)!r} does not exist or is not a file; pass the path of a .gguf file "
                "(e.g. the one `kvpilot fetch-model smollm2-135m` prints)"
            )
        if self.path.stat().st_size == 0:
            raise ModelLoadError(f"{self.path}: the file is empty, not a GGUF file; {_REPAIR_HINT}")
        with self.path.open("rb") as handle:
            magic = handle.read(len(GGUF_MAGIC))
        if magic != GGUF_MAGIC:
            raise ModelLoadError(
                f"{self.path}: not a GGUF file (it starts with {magic!r}, a GGUF file with {GGUF_MAGIC!r}); "
                "kvpilot loads a .gguf file or a Hugging Face model folder"
            )
        reader = _open_reader(self.path)
        self._fields = reader.fields
        self.tensors = {tensor.name: tensor for tensor in reader.tensors}
        self.architecture: str = self.require("general.architecture", str)
        split_count = self.get("split.count", int)
        if split_count is not None and split_count > 1:
            raise ModelLoadError(
                f"{self.path}: this is one of {split_count} parts of a split GGUF model; kvpilot loads single "
                "files. Merge the parts first: llama-gguf-split --merge FIRST-PART.gguf merged.gguf"
            )

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, kind: type, default: Any = None) -> Any:
        """The value of metadata ``key`` (int, float, str, bool or list), or ``default`` when absent."""
        field = self._fields.get(key)
        if field is None:
            return default
        value = field.contents()
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        valid = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if not valid:
            raise ModelLoadError(
                f"{self.path}: GGUF metadata key {key!r} holds {value!r}, expected a {kind.__name__}; {_REPAIR_HINT}"
            )
        return value

    def require(self, key: str, kind: type) -> Any:
        """The value of metadata ``key``; a ModelLoadError naming the key when the file lacks it."""
        value = self.get(key, kind)
        if value is None:
            raise ModelLoadError(
                f"{self.path}: GGUF metadata key {key!r} is missing, and kvpilot needs it to build the model; "
                f"the file is incomplete or was written by an unusual converter: {_REPAIR_HINT}"
            )
        return value


def _open_reader(path: Path):
    gguf = import_gguf()

    class CheckedReader(gguf.GGUFReader):
        """The library's reader, checking each tensor's type and extent before it maps the tensor.

        ``_build_tensors`` is the reader's step from the parsed tensor directory to the mapped
        tensors (gguf 0.17 to 0.19 at least); should a later version rename it, the checks are
        skipped and the reader's own errors still become the generic error below."""

        def _build_tensors(self, start_offs: int, fields: list) -> None:  # noqa: ANN001 (gguf's own hook)
            file_size = len(self.data)
            for field in fields:
                _check_tensor_entry(path, field, start_offs, file_size)
            super()._build_tensors(start_offs, fields)

    try:
        return CheckedReader(str(path))
    except ModelLoadError:
        raise
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as exc:
        # Past the checks above, the reader fails only on a header it cannot parse: a file cut off
        # inside its metadata, or bytes that are not GGUF at all.
        raise ModelLoadError(
            f"{path}: cannot read the GGUF header ({type(exc).__name__}: {exc}); the file is truncated or "
            f"corrupt: {_REPAIR_HINT}"
        ) from exc


def _check_tensor_entry(path: Path, field, data_start: int, file_size: int) -> None:  # noqa: ANN001
    """A clear error for a tensor whose type the gguf package does not know or whose bytes are missing."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    # The reader's tensor-info field: name length, name, number of dims, dims, type id, data offset.
    _, name_bytes, _, dims, raw_type, offset = field.parts
    name = bytes(name_bytes).decode("utf-8", errors="replace")
    type_id = int(raw_type[0])
    try:
        tensor_type = GGMLQuantizationType(type_id)
    except ValueError:
        raise ModelLoadError(
            f"{path}: tensor {name!r} has type id {type_id}, which is not a GGML tensor type known to this "
            "version of the gguf package; the file is corrupt or from a newer llama.cpp. kvpilot loads "
            f"{supported_tensor_types_text()}"
        ) from None
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    num_elements = int(np.prod(dims.astype(np.uint64), dtype=np.uint64))
    num_bytes = num_elements * type_size // block_size
    end = data_start + int(offset[0]) + num_bytes
    if end > file_size:
        raise ModelLoadError(
            f"{path}: tensor {name!r} ({tensor_type.name}, shape {tuple(int(d) for d in dims)}) needs bytes up to "
            f"offset {end:,} but the file ends at {file_size:,}: the file is truncated (an interrupted "
            f"download or copy?); {_REPAIR_HINT}"
        )


def supported_tensor_types_text() -> str:
    return "tensors of type " + ", ".join(SUPPORTED_TENSOR_TYPES)


def import_gguf():
    """The gguf package, or a ModelLoadError saying how to install it (HF folders do not need it)."""
    try:
        import gguf
    except ImportError:
        raise ModelLoadError(
            "loading a .gguf file needs the gguf package: pip install 'kvpilot[engine]' (or pip install gguf)"
        ) from None
    return gguf
