"""Switch for the eager decode fast paths (``FLEETSERVE_DECODE_FAST_PATH``).

On by default. ``FLEETSERVE_DECODE_FAST_PATH=0`` (or ``false`` / ``no``) makes the
layers take their general paths again: the padded boolean mask even when every
key is visible, one rotary call per tensor, ``__setitem__`` KV writes, the
generic gemm wrappers. Both paths give the same float32 results (bit for bit
except the attention kernel's mask-free call; see docs/benchmarks.md,
"engine-c1-notes"); the switch exists so that a benchmark can time both side by
side in one process (``benchmarks/decode_fast_path.py`` flips :data:`ENABLED`).
"""

from __future__ import annotations

import os

#: Read by the layers at every call (a module attribute, so a benchmark may flip it).
ENABLED: bool = os.environ.get("FLEETSERVE_DECODE_FAST_PATH", "1").strip().lower() not in ("0", "false", "no")
