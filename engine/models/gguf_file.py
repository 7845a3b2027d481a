"""One GGUF file (llama.cpp's single-file checkpoint), opened with the `gguf` package.

The file is memory-mapped: opening it reads the header, metadata and tensor directory, never the
weights. Every way a file can be unusable becomes a ModelLoadError that names the file and what
is wrong with it (the key, or the tensor and its type), because the gguf reader itself raises
bare ValueErrors ("cannot reshape array of size ...") that do not say which tensor is at fault.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from kvpilot.engine.checkpoint import GGUF_MAGIC, ModelLoadError

# The GGML tensor types kvpilot dequantizes (with the gguf package's dequantizers): the float
# types, llama.cpp's legacy block quantizations, and the two k-quants of the common Q4_K_M files.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K")
_REPAIR_HINT = "re-download the file, or re-convert the model with llama.cpp's convert_hf_to_gguf.py"


class GGUFFile:
    """Metadata and tensor directory of a GGUF file; tensors are memory-mapped numpy arrays.

    ``tensors`` maps each name to a ``GGUFTensor`` (``tensor_type``, ``shape`` in GGML order, i.e.
    innermost dimension first, and ``data``, the raw bytes or values).
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
        self._metadata, self.tensors = _read(self.path)
        self.architecture: str = self.require("general.architecture", str)
        split_count = self.get("split.count", int)
        if split_count is not None and split_count > 1:
            raise ModelLoadError(
                f"{self.path}: this is one of {split_count} parts of a split GGUF model; kvpilot loads single "
                "files. Merge the parts first: llama-gguf-split --merge FIRST-PART.gguf merged.gguf"
            )

    def __contains__(self, key: str) -> bool:
        return key in self._metadata

    def get(self, key: str, kind: type, default: Any = None) -> Any:
        """The value of metadata ``key`` (int, float, str, bool or list), or ``default`` when absent."""
        value = self._metadata.get(key)
        if value is None:
            return default
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


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGML order: innermost dimension first
    n_elements: int
    n_bytes: int
    data_offset: int
    data: Any  # numpy view of the memory-mapped bytes: float arrays as values, quantized ones as bytes


# GGUF metadata value types (the format's numbering) and how each is stored, little-endian.
_STRING, _ARRAY = 8, 9
_NUMBERS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
            12: "<f8"}


class _Cursor:
    """Reads the header's values in order from the memory-mapped file."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data, self.offset = data, 0

    def _take(self, size: int) -> int:
        start, self.offset = self.offset, self.offset + size
        if self.offset > len(self.data):
            raise IndexError(f"the header needs byte {self.offset:,}, past the end of the file")
        return start

    def numbers(self, kind: str, count: int) -> np.ndarray:
        dtype = np.dtype(kind)
        return np.frombuffer(self.data, dtype, count, self._take(dtype.itemsize * count))

    def number(self, kind: str) -> int | float | bool:
        fmt = _STRUCT[kind]
        return struct.unpack_from(fmt, self.data, self._take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        length = self.number("<u8")
        start = self._take(length)
        return self.data[start:self.offset].decode("utf-8")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.number("<u4"), self.number("<u8")
            if item_kind == _STRING:
                return [self.string() for _ in range(count)]
            if item_kind == _ARRAY:
                return [self.value(self.number("<u4")) for _ in range(count)]
            return self.numbers(_NUMBERS[item_kind], count).tolist()
        return self.number(_NUMBERS[kind])


_STRUCT = {"<u1": "<B", "<i1": "<b", "<u2": "<H", "<i2": "<h", "<u4": "<I", "<i4": "<i", "<f4": "<f", "?": "<?",
           "<u8": "<Q", "<i8": "<q", "<f8": "<d"}


def _read(path: Path) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    """The metadata and the tensor directory, the tensors memory-mapped (nothing of them read).

    kvpilot's own reader: the gguf package's builds numpy views of every value of the header (a
    vocabulary of 49k tokens took 3.5 s, on each of the three reads a load made); this reads the
    values once into Python objects and maps the tensors with the same types and shapes."""
    gguf = import_gguf()
    with path.open("rb") as handle:
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    data = np.frombuffer(mapped, dtype=np.uint8)  # the tensors' views keep the map open
    try:
        cursor = _Cursor(mapped)
        cursor.numbers("<u1", 4)  # magic, checked by the caller
        version = cursor.number("<u4")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (kvpilot reads versions 2 and 3, little-endian)")
        num_tensors, num_values = cursor.number("<u8"), cursor.number("<u8")
        metadata = {}
        for _ in range(num_values):
            key = cursor.string()
            metadata[key] = cursor.value(int(cursor.number("<u4")))
        entries = []
        for _ in range(num_tensors):
            name = cursor.string()
            dims = cursor.numbers("<u8", int(cursor.number("<u4"))).tolist()
            entries.append((name, dims, int(cursor.number("<u4")), int(cursor.number("<u8"))))
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as exc:
        # The header cannot be parsed: a file cut off inside its metadata, or bytes that are not GGUF.
        raise ModelLoadError(
            f"{path}: cannot read the GGUF header ({type(exc).__name__}: {exc}); the file is truncated or "
            f"corrupt: {_REPAIR_HINT}"
        ) from exc
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-cursor.offset // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, type_id, offset in entries:
        if name in tensors:
            raise ModelLoadError(f"{path}: tensor {name!r} appears twice in the tensor directory; {_REPAIR_HINT}")
        tensors[name] = _map_tensor(gguf, path, data, name, dims, type_id, data_start + offset)
    return metadata, tensors


def _map_tensor(gguf, path: Path, data: np.ndarray, name: str, dims: list[int], type_id: int,  # noqa: ANN001
                start: int) -> GGUFTensor:
    """One tensor as a view of the file, after checking that its type is known and its bytes are there."""
    try:
        tensor_type = gguf.GGMLQuantizationType(type_id)
    except ValueError:
        raise ModelLoadError(
            f"{path}: tensor {name!r} has type id {type_id}, which is not a GGML tensor type known to this "
            "version of the gguf package; the file is corrupt or from a newer llama.cpp. kvpilot loads "
            f"{supported_tensor_types_text()}"
        ) from None
    block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
    num_elements = int(np.prod(dims, dtype=np.uint64))
    num_bytes = num_elements * type_size // block_size
    if start + num_bytes > len(data):
        raise ModelLoadError(
            f"{path}: tensor {name!r} ({tensor_type.name}, shape {tuple(dims)}) needs bytes up to offset "
            f"{start + num_bytes:,} but the file ends at {len(data):,}: the file is truncated (an interrupted "
            f"download or copy?); {_REPAIR_HINT}"
        )
    shape = tuple(reversed(dims))
    raw = data[start:start + num_bytes]
    value_types = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                   "I32": np.int32, "I64": np.int64}
    if tensor_type.name in value_types:
        values = raw.view(value_types[tensor_type.name]).reshape(shape)
    else:  # quantized blocks (and BF16): bytes, one row of blocks per row
        values = raw.reshape(gguf.quant_shape_to_byte_shape(shape, tensor_type))
    return GGUFTensor(name, tensor_type, tuple(dims), num_elements, num_bytes, start, values)


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
