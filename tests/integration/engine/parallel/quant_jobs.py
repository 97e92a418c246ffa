"""Per-rank job for the --quantization TP test (run inside a RankPool)."""

from fleetserve.testing import rank_pool
from fleetserve.testing.rank_engine import build_rank_engine, drive
from parallel_jobs import greedy_req


def quant_tokens_job(rank, world, model_dir, sizes, quantization, prompts, n_new):
    """Greedy tokens of every prompt on this rank's engine with ``--quantization quantization``."""
    eng = build_rank_engine(rank, model_dir, timeout_s=rank_pool.TIMEOUT_S, dtype="float32",
                            max_total_tokens=512, quantization=quantization, **sizes)
    assert eng.runner.quantization == quantization
    out = drive(eng, {0: [greedy_req(f"p{i}", p, n_new) for i, p in enumerate(prompts)]})
    return {rid: r["ids"] for rid, r in out["reqs"].items()}


def weight_only_shards_job(rank, world, mode, seed):
    """This rank's quantized shards of a column- and a row-parallel linear (TP = world, gloo) and its
    all-reduced output: ``(col dequantized, row dequantized, col(x), row(x shard))``."""
    import torch

    from fleetserve.layers.linear import ColumnParallelLinear, RowParallelLinear, TPGroup
    from fleetserve.layers.quantization import apply_quantization

    g = torch.Generator().manual_seed(seed)
    up, down = torch.randn(96, 64, generator=g) / 8, torch.randn(48, 128, generator=g) / 11
    x, h = torch.randn(3, 64, generator=g), torch.randn(3, 128, generator=g)

    class Src:
        def read(self, name, dim=None, start=None, end=None):
            t = {"up": up, "down": down}[name]
            return t if dim is None else t.narrow(dim, start, end - start)

    tp = TPGroup(rank, world, None)  # the pool's default gloo group
    col = ColumnParallelLinear(64, [96], tp=tp)
    col.load(Src(), "up")
    row = RowParallelLinear(128, 48, tp=tp)
    row.load(Src(), "down")
    assert apply_quantization(torch.nn.ModuleList([col, row]), mode) == mode
    with torch.inference_mode():
        return (col._gemm.dequantized(), row._gemm.dequantized(), col(x),
                row(h[:, row.col_start:row.col_end]))


def smoothed_int8_job(rank, world, model_dir, sizes, prompts, n_new):
    """``--quantization int8`` (SmoothQuant) on this rank: (every RMSNorm weight after the fold,
    the smoothed QKV weight's dequantized rows as this rank holds them, greedy tokens)."""
    from fleetserve.layers.norm import RMSNorm

    eng = build_rank_engine(rank, model_dir, timeout_s=rank_pool.TIMEOUT_S, dtype="float32",
                            max_total_tokens=512, quantization="int8", **sizes)
    model = eng.runner.model
    norms = [m.weight.detach().clone() for m in model.modules() if isinstance(m, RMSNorm)]
    qkv = model.layers[0].self_attn.qkv_proj
    w = torch_dequantized_rows(qkv._gemm)
    out = drive(eng, {0: [greedy_req(f"p{i}", p, n_new) for i, p in enumerate(prompts)]})
    return norms, w, {rid: r["ids"] for rid, r in out["reqs"].items()}


def torch_dequantized_rows(gemm):
    """The float32 weight an :class:`Int8DynamicGemm` multiplies by (its int8 codes times the row scales)."""
    import torch

    qw = torch.ops.quantized.linear_unpack(gemm._packed)[0]
    return qw.dequantize()
