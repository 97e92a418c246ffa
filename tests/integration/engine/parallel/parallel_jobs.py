"""Per-rank jobs for the multi-rank engine tests (run inside a RankPool), and the
transformers reference they are compared with."""

import torch

from fleetserve.testing import rank_pool
from fleetserve.testing.rank_engine import build_rank_engine, drive
from fleetserve.engine.io_struct import TokenizedGenerateReq
from fleetserve.engine.sampling_params import SamplingParams


def greedy_req(rid, ids, n_new):
    return TokenizedGenerateReq(rid, list(ids), SamplingParams(temperature=0, max_new_tokens=n_new, ignore_eos=True))


def parity_job(rank, world, model_dir, sizes, prompts, n_new):
    """Prompt i goes to attention group i % attn_dp_size; returns this rank's requests."""
    eng = build_rank_engine(rank, model_dir, timeout_s=rank_pool.TIMEOUT_S, dtype="float32",
                            max_total_tokens=512, **sizes)
    ps = eng.pstate
    mine = [i for i in range(len(prompts)) if i % ps.attn_dp_size == ps.attn_dp_rank]
    out = drive(eng, {0: [greedy_req(f"p{i}", prompts[i], n_new) for i in mine]}, record_logits=True)
    eng.scheduler.check_kv()
    return {rid: (r["ids"], r["logits"]) for rid, r in out["reqs"].items()}


def scenario_job(rank, world, model_dir, sizes, plan):
    """Staggered arrivals and aborts: ``plan[attn_dp_rank] = (arrivals, aborts)`` with
    ``arrivals = {step: [(rid, prompt, n_new), ...]}``. Also counts forwards per mode."""
    eng = build_rank_engine(rank, model_dir, timeout_s=rank_pool.TIMEOUT_S, dtype="float32",
                            max_total_tokens=512, **sizes)
    ps = eng.pstate
    arrivals_spec, aborts = plan[ps.attn_dp_rank]
    arrivals = {s: [greedy_req(rid, p, n) for rid, p, n in reqs] for s, reqs in arrivals_spec.items()}
    modes = []
    forward = eng.runner.forward

    def counting(batch):
        modes.append(batch.mode.name)
        return forward(batch)

    eng.runner.forward = counting
    stats = []
    out = drive(eng, arrivals, aborts, on_step=lambda i, s: stats.append(s.get_stats().kv_used_tokens))
    eng.scheduler.check_kv()
    final = eng.scheduler.get_stats()
    return {"reqs": {rid: (r["ids"], r["finish_reason"]) for rid, r in out["reqs"].items()},
            "modes": modes, "steps": out["steps"], "kv_used_end": final.kv_used_tokens,
            "kv_pool": final.kv_pool_size}


def hf_greedy(model_dir: str, prompts: list[list[int]], n_new: int) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' own model: greedy tokens and the float32 logits row that chose each one."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            rows = []
            for _ in range(n_new):
                logits = model(torch.tensor([ids])).logits[0, -1].float()
                rows.append(logits)
                ids.append(int(logits.argmax()))
            out.append((ids[len(p):], torch.stack(rows)))
    return out


def capacity_job(rank, world, model_dir, sizes, max_total_tokens, prompts, n_new):
    """Fill the instance: every attention group gets ``prompts[d::D]`` at once.
    Returns the pool size, bytes per token, and the peak KV tokens this rank held."""
    eng = build_rank_engine(rank, model_dir, timeout_s=rank_pool.TIMEOUT_S, dtype="float32",
                            max_total_tokens=max_total_tokens, chunked_prefill_size=-1, **sizes)
    ps = eng.pstate
    mine = [i for i in range(len(prompts)) if i % ps.attn_dp_size == ps.attn_dp_rank]
    peak = [0]

    def watch(_i, sched):
        st = sched.get_stats()
        peak[0] = max(peak[0], st.kv_used_tokens)

    out = drive(eng, {0: [greedy_req(f"c{i}", prompts[i], n_new) for i in mine]}, on_step=watch)
    st = eng.scheduler.get_stats()
    return {"attn_dp_rank": ps.attn_dp_rank, "attn_tp_rank": ps.attn_tp_rank, "kv_pool_size": st.kv_pool_size,
            "kv_bytes_per_token": st.kv_bytes_per_token, "peak_used": peak[0],
            "finished": sorted(r for r, v in out["reqs"].items() if v["finish_reason"] is not None)}


def retract_job(rank, world, model_dir, sizes, max_total_tokens, conservativeness, plan):
    """Attention group ``d`` gets ``plan[d]`` (``(rid, prompt, n_new)`` each) at step 0 in a small KV pool with a
    low ``--schedule-conservativeness``, so that it admits more than its pool can grow into
    and must retract. The KV invariant is checked after every step."""
    eng = build_rank_engine(rank, model_dir, timeout_s=rank_pool.TIMEOUT_S, dtype="float32",
                            max_total_tokens=max_total_tokens, chunked_prefill_size=-1,
                            schedule_conservativeness=conservativeness, **sizes)
    ps, sched = eng.pstate, eng.scheduler
    modes, running = [], []
    forward = eng.runner.forward

    def counting(batch):
        modes.append(batch.mode.name)
        return forward(batch)

    def watch(_i, s):
        s.check_kv()
        running.append(len(s.running))

    eng.runner.forward = counting
    reqs = [greedy_req(rid, p, n) for rid, p, n in plan[ps.attn_dp_rank]]
    out = drive(eng, {0: reqs}, on_step=watch)
    final = sched.get_stats()
    return {"reqs": {rid: (r["ids"], r["finish_reason"]) for rid, r in out["reqs"].items()},
            "retracted": sched.num_retracted, "modes": modes, "steps": out["steps"], "max_running": max(running),
            "kv_used_end": final.kv_used_tokens, "kv_pool": final.kv_pool_size}
