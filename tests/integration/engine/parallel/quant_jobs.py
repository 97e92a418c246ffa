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
