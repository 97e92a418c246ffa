"""fbgemm's fp16-weight GEMM reached from C++, without Python boxing the packed weight (opt-in).

``torch.ops.quantized.linear_dynamic_fp16(x, packed)`` takes its weight as a TorchScript custom
class object (``LinearPackedParamsBase``). Called from Python, converting that object to the
dispatcher's ``IValue`` costs most of the call: measured 34-36 us of CPU per call on a 1 x 64 x 64
linear (1 thread, this project's AVX2 EPYC, load ~8-11) against 5 us for the same kernel reached
through the op below (docs/benchmarks.md, engine-c1-k). SmolLM2 runs 121 linears per decode token,
so at concurrency 1 that is ~4 ms of a ~30 ms step, on the main thread only.

This module compiles (``torch.utils.cpp_extension.load_inline``, once; cached under
``TORCH_EXTENSIONS_DIR``) a two-op library ``fleetserve_fp16``:

* ``register_packed(LinearPackedParamsBase p) -> int``: keeps ``p`` in a C++ table, returns its handle;
* ``gemm(Tensor x, int handle) -> Tensor``: ``p->apply_dynamic(x)`` -- the quantized op's own
  kernel entry (``PackedLinearWeightFp16::apply_dynamic``), so the result is the same bit for bit
  and the GEMM splits over ``torch.get_num_threads()`` as before. ``x``: float32 ``[T, in]``;
  returns float32 ``[T, out]``.

Because ``gemm`` takes only a tensor and an int, ``torch.compile`` can put it straight into the
graph (:func:`fleetserve.layers.opaque_gemm.linear_gemm`), so a compiled step (with inductor's
``cpp_wrapper``) reaches the kernel with no Python in between.

Opt-in: ``FLEETSERVE_FP16_GEMM_EXT=1`` in the environment (read once, at first use). Off by
default because the first use compiles C++ (~1-2 min on 2 loaded cores) and needs a C++
compiler (``--enable-torch-compile`` needs one too). A failed build logs one warning and
leaves the quantized op in use.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

#: Environment switch (``1`` = on).
ENV = "FLEETSERVE_FP16_GEMM_EXT"

_SOURCE = r"""
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/native/quantized/PackedParams.h>
#include <mutex>
#include <vector>

namespace {
std::mutex table_mutex;
std::vector<c10::intrusive_ptr<LinearPackedParamsBase>> table;

int64_t register_packed(const c10::intrusive_ptr<LinearPackedParamsBase>& p) {
  std::lock_guard<std::mutex> guard(table_mutex);
  table.push_back(p);
  return static_cast<int64_t>(table.size()) - 1;
}

at::Tensor gemm(const at::Tensor& x, int64_t handle) {
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(table.size()), "fleetserve_fp16::gemm: bad handle");
  return table[handle]->apply_dynamic(x.contiguous(), false);
}
}  // namespace

TORCH_LIBRARY(fleetserve_fp16, m) {
  m.def("register_packed(__torch__.torch.classes.quantized.LinearPackedParamsBase p) -> int", register_packed);
  m.def("gemm(Tensor x, int handle) -> Tensor");
  m.impl("gemm", c10::DispatchKey::CPU, TORCH_FN(gemm));
}
"""

_state: dict[str, object] = {}
_OUT: dict[int, int] = {}  # handle -> out_features (for the fake kernel)


def enabled() -> bool:
    """Whether the extension is switched on and built (builds it at the first call)."""
    if "ok" not in _state:
        _state["ok"] = False
        if os.environ.get(ENV, "0") == "1":
            try:
                from torch.utils.cpp_extension import load_inline

                load_inline(name="fleetserve_fp16", cpp_sources=[_SOURCE], is_python_module=False,
                            extra_cflags=["-O2"])

                @torch.library.register_fake("fleetserve_fp16::gemm")
                def _(x: torch.Tensor, handle: int) -> torch.Tensor:
                    return x.new_empty((x.shape[0], _OUT[handle]))

                _state["ok"] = True
                logger.info("%s=1: fp16-weight linears call fbgemm through the fleetserve_fp16 C++ op", ENV)
            except Exception as e:  # no compiler, missing headers: keep the quantized op
                logger.warning("%s=1 but building the fleetserve_fp16 extension failed (%s: %s); "
                               "using torch.ops.quantized.linear_dynamic_fp16", ENV, type(e).__name__,
                               str(e).splitlines()[0][:200] if str(e) else "")
    return bool(_state["ok"])


def register(packed: object, out_features: int) -> int:
    """Handle of ``packed`` (a ``linear_prepack_fp16`` object) in the C++ table; needs :func:`enabled`."""
    h = int(torch.ops.fleetserve_fp16.register_packed(packed))
    _OUT[h] = int(out_features)
    return h


def gemm(x: torch.Tensor, handle: int) -> torch.Tensor:
    """``x [T, in]`` float32 times the registered fp16 weight: ``[T, out]`` float32."""
    return torch.ops.fleetserve_fp16.gemm.default(x, handle)
