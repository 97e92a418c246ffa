"""--quantization bf16_linear: oneDNN bfloat16 linears against the exact product of the
bf16-rounded operands (output rounded to bf16 too), shapes / bias / dtypes, per-shard equality under TP, the CPU flag test."""

import pytest
import torch

from fleetserve.core.cpu_features import has_amx_bf16
from fleetserve.layers import bf16_gemm
from fleetserve.layers.bf16_gemm import Bf16LinearGemm
from fleetserve.layers.linear import ColumnParallelLinear, TPGroup
from fleetserve.layers.quantization import apply_quantization, resolve_quantization
from helpers.weight_source import DictSource, column_row_pair

pytestmark = pytest.mark.skipif(not bf16_gemm.available(), reason="no oneDNN packed linear in this torch")

SHAPES = [(576, 960), (1536, 576), (576, 49152 // 16)]


def rel(y, ref):
    return ((y - ref).norm() / ref.norm()).item()


def rounded_ref(x, w):
    """The product of the bf16-rounded operands, accumulated in float64 (what the kernel approximates)."""
    return (x.bfloat16().double() @ w.bfloat16().double().T).float()


def within_one_bf16_ulp(y, ref):
    """oneDNN accumulates in float32 and rounds its output to bfloat16 (relative half-ulp 2^-9)."""
    return bool((y - ref).abs().le(ref.abs() * 2 ** -8 + 1e-6).all())


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("rows", [1, 5, 32, 130])
def test_gemm_is_the_product_of_bf16_rounded_operands(k, n, rows):
    g = torch.Generator().manual_seed(k + n + rows)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    x = torch.randn(rows, k, generator=g)
    y = Bf16LinearGemm(w)(x)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    # the exact product of the rounded operands, rounded once more to bf16 ...
    assert within_one_bf16_ulp(y, rounded_ref(x, w))
    assert torch.equal(y, y.bfloat16().float())
    # ... which puts it ~3e-3 from float32 (three roundings of 2^-9 per element)
    assert 1e-3 < rel(y, x @ w.T) < 6e-3


def test_shapes_bias_and_dtype():
    w, b = torch.randn(16, 8), torch.randn(16)
    x = torch.randn(2, 3, 8)
    gemm = Bf16LinearGemm(w)
    y = gemm(x, w, b)
    assert y.shape == (2, 3, 16) and y.dtype == torch.float32
    assert within_one_bf16_ulp(y - b, rounded_ref(x.reshape(6, 8), w).reshape(2, 3, 16))
    assert gemm(torch.randn(0, 8)).shape == (0, 16)
    assert gemm(x.bfloat16()).dtype == torch.bfloat16
    assert gemm(x[:, :, :].transpose(0, 1)).shape == (3, 2, 16)  # non-contiguous input


def test_amx_detection_needs_both_flags():
    assert has_amx_bf16({"amx_bf16", "amx_tile", "avx512f"})
    assert not has_amx_bf16({"amx_tile", "amx_int8"}) and not has_amx_bf16({"avx512_bf16", "avx512f"})


def test_mode_resolves_and_swaps_every_linear_per_shard():
    assert resolve_quantization("bf16_linear") == "bf16_linear"
    with pytest.raises(ValueError, match=r"^--quantization bf16_linear runs on CPU only"):
        resolve_quantization("bf16_linear", "cuda")

    g = torch.Generator().manual_seed(3)
    src = DictSource(up=torch.randn(64, 48, generator=g) / 7, down=torch.randn(48, 64, generator=g) / 8)
    x = torch.randn(5, 48, generator=g)

    def build(rank, size):
        col, row = column_row_pair(src, rank, size, "bf16_linear")
        assert isinstance(col._gemm, Bf16LinearGemm) and isinstance(row._gemm, Bf16LinearGemm)
        return col, row

    full_col, full_row = build(0, 1)
    with torch.inference_mode():
        y_full = full_col(x)
        parts, row_sum = [], 0
        for r in range(2):
            col, row = build(r, 2)
            parts.append(col(x))
            row_sum = row_sum + row(y_full[:, r * 32:(r + 1) * 32])
        # bf16 rounding is per element: column shards are exactly the whole's columns; the
        # row-parallel partial sums are rounded to bf16 before they are added
        assert torch.equal(torch.cat(parts, -1), y_full)
        assert rel(row_sum, full_row(y_full)) < 6e-3  # each shard's output is rounded to bf16 on its own
        assert 1e-3 < rel(y_full, x @ src.t["up"].T) < 6e-3


def test_lm_head_top_logits_are_float32s():
    """The LM head's 16 largest bf16 logits per row are recomputed in float32: on rows built with
    near ties among the top tokens the argmax is float32's, where the plain bf16 head flips some."""
    from fleetserve.layers.linear import ParallelLMHead
    from fleetserve.layers.rescored_head import RescoredHead

    g = torch.Generator().manual_seed(5)
    vocab, hidden, rows = 4096, 64, 256
    head = ParallelLMHead(vocab, hidden)
    head.weight.data.copy_(torch.randn(vocab, hidden, generator=g))
    h = torch.randn(rows, hidden, generator=g)
    # near ties: the top rows of the weight nearly repeat, so the top logits differ by ~1e-3 relative
    head.weight.data[:8] = head.weight.data[0] + 1e-3 * torch.randn(8, hidden, generator=g)
    h[:, :] = h + 3 * head.weight.data[0] / head.weight.data[0].norm()
    with torch.inference_mode():
        ref = h @ head.weight.T
        assert apply_quantization(torch.nn.ModuleList([head]), "bf16_linear") == "bf16_linear"
        assert isinstance(head._gemm, RescoredHead)
        got = head(h)
        plain = Bf16LinearGemm(head.weight)(h)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert (plain.argmax(-1) != ref.argmax(-1)).sum() > 0  # the test has ties bf16 alone gets wrong
    top = ref.topk(4, -1).indices  # float32's top 4 are among bf16's top 16, so recomputed exactly
    assert torch.allclose(got.gather(1, top), ref.gather(1, top), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain.gather(1, top), ref.gather(1, top), rtol=1e-5, atol=1e-5)


class CountingGemm(Bf16LinearGemm):
    """Counts which entry a compiled graph used: the bare kernel (bf16_2d) or the whole call."""

    __slots__ = ("kernel_calls", "whole_calls")

    def __init__(self, weight):
        super().__init__(weight)
        self.kernel_calls = self.whole_calls = 0

    def bf16_2d(self, xb):
        self.kernel_calls += 1
        return super().bf16_2d(xb)

    def __call__(self, x, weight=None, bias=None):
        self.whole_calls += 1
        return super().__call__(x, weight, bias)


@pytest.mark.timeout(300)
def test_compiled_graph_calls_the_bare_kernel_with_eagers_values():
    """Under torch.compile a bf16_linear layer emits fleetserve::gemm_bf16 (the kernel alone; the casts
    are graph nodes inductor fuses) and gives eager's values bit for bit."""
    from fleetserve.layers.opaque_gemm import register_gemm_layers

    g = torch.Generator().manual_seed(7)
    col = ColumnParallelLinear(48, [64], tp=TPGroup(0, 1))
    col.weight.data.copy_(torch.randn(64, 48, generator=g) / 7)
    col._gemm = CountingGemm(col.weight)
    assert register_gemm_layers(torch.nn.ModuleList([col])) == 1
    x = torch.randn(6, 48, generator=g)
    with torch.inference_mode():
        want = col(x) * 2 - 1  # exact element-wise ops: inductor's kernel gives the same bits
        assert (col._gemm.whole_calls, col._gemm.kernel_calls) == (1, 1)
        f = torch.compile(lambda t: col(t) * 2 - 1, fullgraph=True)
        got = f(x)
        got2 = f(x)
    assert torch.equal(got, want) and torch.equal(got2, want)
    assert col._gemm.whole_calls == 1 and col._gemm.kernel_calls >= 3  # compiled calls: the bare kernel only
