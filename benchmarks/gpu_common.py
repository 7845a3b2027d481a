"""Helpers shared by the GPU benchmark scripts: peak bandwidth, timing, tables, result files.

Import only after the caller has decided on TRITON_INTERPRET (CPU smoke runs set it first).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

# Peak HBM bandwidth in TB/s by device-name fragment (vendor data sheets), most specific first.
PEAK_BANDWIDTH_TBS = (
    ("H200", 4.8),
    ("GH200", 4.0),
    ("H100 NVL", 3.9),
    ("H100 PCIe", 2.0),
    ("H100", 3.35),
    ("H800", 3.35),
    ("B200", 8.0),
    ("A100-SXM4-80GB", 2.039),
    ("A100 80GB PCIe", 1.935),
    ("A100", 1.555),
    ("L40S", 0.864),
    ("L4", 0.3),
    ("A10G", 0.6),
    ("RTX 4090", 1.008),
)
PEAK_ENV = "KVPILOT_PEAK_BW_TBS"


def peak_bandwidth(device: torch.device, override_tbs: float | None) -> tuple[float | None, str]:
    """(bytes/s or None, where the number came from): --peak-bw-tbs, $KVPILOT_PEAK_BW_TBS, or the device name."""
    if override_tbs is None and os.environ.get(PEAK_ENV):
        try:
            override_tbs = float(os.environ[PEAK_ENV])
        except ValueError:
            raise SystemExit(f"{PEAK_ENV} must be a number of TB/s, got {os.environ[PEAK_ENV]!r}") from None
    if override_tbs is not None:
        if override_tbs <= 0:
            raise SystemExit(f"peak bandwidth must be positive TB/s, got {override_tbs}")
        return override_tbs * 1e12, f"given: {override_tbs} TB/s"
    if device.type != "cuda":
        return None, "no peak for CPU smoke runs"
    name = torch.cuda.get_device_name(device)
    for fragment, tbs in PEAK_BANDWIDTH_TBS:
        if fragment in name:
            return tbs * 1e12, f"{name}: {tbs} TB/s (data sheet)"
    return None, f"{name}: unknown peak; pass --peak-bw-tbs or set {PEAK_ENV}"


_flush_buffer: torch.Tensor | None = None


def _flush_l2() -> None:
    """Overwrite 256 MiB so the next kernel reads from HBM, not from a warm L2 (50 MB on H100/H200)."""
    global _flush_buffer
    if _flush_buffer is None:
        _flush_buffer = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    _flush_buffer.zero_()


def time_ms(fn: Callable[[], object], device: torch.device, reps: int = 30) -> float:
    """Median milliseconds of fn.

    On CUDA fn is captured in a CUDA graph and replayed (launch overhead out, as in the engine's decode
    path), with L2 flushed before each timed replay. On CPU: wall-clock of a few plain calls.
    """
    if device.type != "cuda":
        fn()
        times = []
        for _ in range(max(1, min(reps, 3))):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile / autotune / allocate before capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    graph.replay()
    for start, end in zip(starts, ends):
        _flush_l2()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    result = statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))
    del graph
    return result


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def write_results(out_dir: str | None, name: str, payload: dict, markdown: str) -> None:
    """Write <name>.json and <name>.md under out_dir (nothing when out_dir is empty)."""
    if not out_dir:
        return
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    (out / f"{name}.md").write_text(markdown + "\n")
    print(f"wrote {out / (name + '.json')} and {out / (name + '.md')}")


def environment(device: torch.device) -> dict:
    import triton

    info = {"torch": torch.__version__, "triton": triton.__version__, "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1))
    return info
