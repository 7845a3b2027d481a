"""The CPU's instruction-set features, probed once: every CPU-specific path asks here.

Machines differ (some have AVX-512 with BF16 and VNNI, some only AVX2), so a fast path that needs
a feature checks for it and keeps a plain fallback. The flags come from ``/proc/cpuinfo`` (the
names Linux prints). ``KVPILOT_CPU_FEATURES`` takes features away for tests and comparisons, e.g.
``KVPILOT_CPU_FEATURES=-avx512f,-avx512_vnni`` runs an AVX-512 machine as an AVX2 one: the C
kernels are then compiled without those instructions too (``compile_flags``). Features the CPU lacks
cannot be added: code built for them would die with SIGILL.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)
ENV = "KVPILOT_CPU_FEATURES"
# Removing a feature removes the ones built on it (and removing avx512f every avx512* flag: parse);
# each maps to the gcc flag that turns it off.
_IMPLIED = {
    "avx2": ("avx512f", "avx_vnni", "fma"),
    "avx512f": ("amx_tile", "amx_bf16", "amx_int8"),
}
_GCC_OFF = {
    "avx2": "-mno-avx2",
    "fma": "-mno-fma",
    "avx512f": "-mno-avx512f",
    "avx512bw": "-mno-avx512bw",
    "avx512vl": "-mno-avx512vl",
    "avx512dq": "-mno-avx512dq",
    "avx512_vnni": "-mno-avx512vnni",
    "avx512_bf16": "-mno-avx512bf16",
    "avx_vnni": "-mno-avxvnni",
    "amx_tile": "-mno-amx-tile",
    "amx_bf16": "-mno-amx-bf16",
    "amx_int8": "-mno-amx-int8",
}


@dataclass(frozen=True)
class CpuFeatures:
    flags: frozenset[str]
    removed: frozenset[str] = frozenset()  # taken away by KVPILOT_CPU_FEATURES

    def has(self, *names: str) -> bool:
        return all(name in self.flags for name in names)

    @property
    def avx512(self) -> bool:
        """AVX-512 F, BW, VL and DQ: what oneDNN's bfloat16 weight reorder and our AVX-512 builds need."""
        return self.has("avx512f", "avx512bw", "avx512vl", "avx512dq")

    @property
    def native_bf16(self) -> bool:
        """Whether the CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX), not by emulation."""
        return self.avx512 and (self.has("avx512_bf16") or self.has("amx_bf16"))

    @property
    def onednn_bf16_prepack(self) -> bool:
        """oneDNN reorders a bfloat16 weight into its blocked layout only with AVX-512 BW/VL/DQ or
        AVX-NE-CONVERT; elsewhere torch raises at the reorder."""
        return self.avx512 or self.has("avx_ne_convert")

    @property
    def int8_matmul_isa(self) -> str | None:
        """The integer dot product the int8-activation kernel (cpu_int8_matmul.c) builds with:
        ``avx512_vnni`` (VPDPBUSD; with AVX-512 BF16 for bfloat16 outputs), else ``avx2``
        (VPMADDUBSW; FMA and F16C for its float32 sums and float16 scales), else None."""
        if self.native_bf16 and self.has("avx512_vnni"):
            return "avx512_vnni"
        return "avx2" if self.has("avx2", "fma", "f16c") else None

    def summary(self) -> str:
        picked = [name for name in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16",
                                    "avx_vnni", "avx_ne_convert") if name in self.flags]
        text = " ".join(picked) or "none of avx2/avx512"
        return text + (f" (removed by {ENV}: {' '.join(sorted(self.removed))})" if self.removed else "")

    def compile_flags(self) -> tuple[str, ...]:
        """gcc flags after -march=native that turn off what was removed."""
        return tuple(_GCC_OFF[name] for name in sorted(self.removed) if name in _GCC_OFF)


def parse(cpu_flags: str, override: str = "") -> CpuFeatures:
    """Features from a ``/proc/cpuinfo`` flags line, less those ``override`` removes (``-name,...``)."""
    flags = set(cpu_flags.replace("flags", " ").replace(":", " ").split())
    removed: set[str] = set()
    for item in (part.strip() for part in override.split(",")):
        if not item:
            continue
        if not item.startswith("-"):
            raise ValueError(f"{ENV}: {item!r}: only features can be removed (write -{item}); "
                             "a feature the CPU lacks cannot be added")
        stack = [item[1:]]
        while stack:
            name = stack.pop()
            removed.add(name)
            stack.extend(_IMPLIED.get(name, ()))
            if name == "avx512f":  # every AVX-512 extension (FP16, VBMI, IFMA, ...) builds on its foundation
                stack.extend(f for f in flags if f.startswith("avx512") and f not in removed)
    return CpuFeatures(frozenset(flags - removed), frozenset(removed))


def cpu_flags_line() -> str:
    """The CPU's feature flags as /proc/cpuinfo prints them (a platform string elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache
def detect() -> CpuFeatures:
    """This CPU's features, probed and logged once per process."""
    features = parse(cpu_flags_line(), os.environ.get(ENV, ""))
    logger.info("CPU features: %s", features.summary())
    return features
