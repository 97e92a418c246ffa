"""What the x86 CPU can do, read from ``/proc/cpuinfo`` (Linux) once per call.

The kernels picked by ``--quantization`` and ``--dtype auto`` depend on instruction
sets torch does not report: ``torch.backends.cpu.get_cpu_capability()`` says
``"AVX512"`` on a Sapphire Rapids Xeon with AMX as on an AMD EPYC without it.
"""

from __future__ import annotations

from typing import Iterable


def cpu_flags() -> set[str]:
    """The CPU flags of ``/proc/cpuinfo`` (empty set where unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def has_vnni(flags: Iterable[str] | None = None) -> bool:
    """Whether the CPU has int8 dot-product instructions (AVX-512 VNNI or AVX-VNNI)."""
    f = set(cpu_flags() if flags is None else flags)
    return bool(f & {"avx512_vnni", "avx512vnni", "avx_vnni"})


def has_amx_bf16(flags: Iterable[str] | None = None) -> bool:
    """Whether the CPU multiplies bfloat16 tiles in hardware (``amx_bf16`` and ``amx_tile``: Intel
    Sapphire Rapids and later)."""
    f = set(cpu_flags() if flags is None else flags)
    return {"amx_bf16", "amx_tile"} <= f
