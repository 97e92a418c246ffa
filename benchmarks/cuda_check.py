"""The engine's CUDA path on a real GPU, in one short run: parity, decode graphs, timings, serve.

Nothing in CI has a GPU, so this script is the check of everything the engine does
only on CUDA: bf16 weights and KV, decode CUDA graphs (capture, bucket padding,
replay), the memory-sized KV pool, NCCL group set-up, and ``fleetserve serve
--device cuda`` end to end. Each part runs on its own (a failure is recorded and the
next part runs) and appends one JSON record to ``--out``:

1. ``env``: GPU name, torch / CUDA versions.
2. ``parity``: the tiny test models (Llama with GQA and llama3 RoPE; DeepSeek-V3 with
   MLA and MoE) on the GPU in float32 (TF32 off), max |logit difference| against
   transformers on the same GPU over EXTEND after a cached prefix and batched DECODE
   steps, with decode graphs on and off; and greedy tokens with graphs == without.
3. ``decode``: a SmolLM2-135M-shaped Llama (random weights, the real tokenizer;
   the GGUF is too large to carry) in bfloat16: graph capture time, decode tok/s of
   64 greedy tokens at batch 1 / 8 / 32 / 64 with graphs and eagerly, and how many
   greedy tokens the two agree on.
4. ``serve``: ``fleetserve serve --device cuda`` on that model, with graphs and
   with ``--disable-cuda-graph``: a closed loop of streamed ``/v1/completions``
   (64 tokens, ``ignore_eos``) at concurrency 1 / 8 / 32: output tok/s and mean TTFT.
5. ``nccl``: a one-rank NCCL group through :func:`fleetserve.distributed.groups`'s
   set-up and an all_reduce; and ``serve --tp-size 2`` on a one-GPU machine is
   refused in one line.

Usage (on a machine with a GPU)::

    python benchmarks/cuda_check.py --tokenizer-dir DIR --out results.jsonl
    python benchmarks/cuda_check.py --render results.jsonl   # writes docs/benchmarks.md

``--device cpu --quick`` runs the same code on a CPU (graphs through the eager stand-in)
to check the script itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "src"))

#: SmolLM2-135M-Instruct's shape (its config.json), for a random model of the same cost.
SMOL_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                  rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2)


def record(out: str, part: str, **fields) -> None:
    rec = {"part": part, **fields}
    print(json.dumps(rec), flush=True)
    with open(out, "a") as f:
        f.write(json.dumps(rec) + "\n")


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---------------------------------------------------------------- parts
def part_env(args) -> dict:
    d = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": args.device}
    if args.device.startswith("cuda"):
        d["gpu"] = torch.cuda.get_device_name(0)
        d["gpus"] = torch.cuda.device_count()
        d["capability"] = list(torch.cuda.get_device_capability(0))
        d["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return d


@torch.no_grad()
def hf_logits(model, tokens: list[int], device: str) -> torch.Tensor:
    return model(torch.tensor([tokens], device=device)).logits[0].float().cpu()


def max_diffs(runner, hf, prompts, cached, steps, device) -> dict:
    """Max |ours - transformers| over a cached-prefix EXTEND, the rest as one EXTEND, then DECODE steps."""
    from helpers.batch_driver import Req, free, run_decode, run_extend

    reqs = [Req([]) for _ in prompts]
    ref = [hf_logits(hf, p + [s[i] for s in steps], device) for i, p in enumerate(prompts)]
    first = [i for i, c in enumerate(cached) if c > 0]
    run_extend(runner, [reqs[i] for i in first], [prompts[i][:cached[i]] for i in first])
    lg = run_extend(runner, reqs, [p[c:] for p, c in zip(prompts, cached)], return_all_logits=True).cpu()
    off, d_ext = 0, 0.0
    for i, (p, c) in enumerate(zip(prompts, cached)):
        n = len(p) - c
        d_ext = max(d_ext, (lg[off:off + n] - ref[i][c:len(p)]).abs().max().item())
        off += n
    d_dec = 0.0
    for s, step in enumerate(steps):
        lg = run_decode(runner, reqs, step).cpu()
        for i, p in enumerate(prompts):
            d_dec = max(d_dec, (lg[i] - ref[i][len(p) + s]).abs().max().item())
    free(runner, reqs)
    return {"extend": d_ext, "decode": d_dec}


def part_parity(args) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from fleetserve.engine.model_runner import ModelRunner
    from helpers.batch_driver import greedy_generate
    from helpers.tiny_models import build_tiny_model

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out = []
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 17, 40)]
    cached = [0, 9, 33]
    steps = [torch.randint(0, 256, (3,), generator=g).tolist() for _ in range(6)]
    for kind in ("llama", "deepseek_v3"):
        path = build_tiny_model(kind, os.path.join(args.work, kind))
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(args.device).eval()
        rec = {"model": kind}
        tokens = {}
        for graphs in (True, False):
            t0 = time.perf_counter()
            runner = ModelRunner(path, dtype="float32", max_total_tokens=4096, device=args.device,
                                 show_progress=False, disable_cuda_graph=not graphs,
                                 eager_graph_stand_in=graphs and not args.device.startswith("cuda"),
                                 graph_seq_len_buckets=[64, 128])
            tag = "graphs" if graphs else "eager"
            rec[f"{tag}_start_s"] = round(time.perf_counter() - t0, 2)
            rec[f"{tag}_graphs_captured"] = len(getattr(runner.graph_runner, "graphs", {}) or {}) \
                if runner.graph_runner is not None else 0
            rec[f"{tag}_max_diff"] = max_diffs(runner, hf, prompts, cached, steps, args.device)
            tokens[tag] = greedy_generate(runner, prompts, 24)
            del runner
        rec["greedy_graphs_equal_eager"] = tokens["graphs"] == tokens["eager"]
        # transformers' greedy on the same prompts, token by token
        ref = []
        for p in prompts:
            ids = hf.generate(torch.tensor([p], device=args.device),
                              attention_mask=torch.ones(1, len(p), dtype=torch.int64, device=args.device),
                              max_new_tokens=24, min_new_tokens=24, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
            ref.append(ids[0, len(p):].tolist())
        rec["greedy_equal_transformers"] = tokens["eager"] == ref
        out.append(rec)
        del hf
    return out


def build_smol_shaped(args) -> str:
    """A SmolLM2-135M-shaped Llama with seeded random weights and SmolLM2's tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from helpers.tiny_models import _reinit

    path = os.path.join(args.work, "smol_shaped")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    shape = dict(SMOL_SHAPE)
    if args.quick:
        shape.update(num_hidden_layers=4)
    config = LlamaConfig(**shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _reinit(model, 0)
    model.save_pretrained(path)
    for name in os.listdir(args.tokenizer_dir):
        src = os.path.join(args.tokenizer_dir, name)
        if os.path.isfile(src) and name != "config.json":
            shutil.copy(src, os.path.join(path, name))
    return path


def part_decode(args) -> list[dict]:
    from fleetserve.engine.model_runner import ModelRunner
    from helpers.batch_driver import greedy_generate

    path = build_smol_shaped(args)
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    g = torch.Generator().manual_seed(1)
    sizes = [1, 8] if args.quick else [1, 8, 32, 64]
    new = 8 if args.quick else 64
    out, tokens = [], {}
    prompts_of = {bs: [torch.randint(3, 49000, (200,), generator=g).tolist() for _ in range(bs)] for bs in sizes}
    for graphs in (True, False):
        sync(args.device)
        t0 = time.perf_counter()
        runner = ModelRunner(path, dtype=dtype, max_total_tokens=None if args.device != "cpu" else 8192,
                             device=args.device, show_progress=False, disable_cuda_graph=not graphs,
                             eager_graph_stand_in=graphs and args.device == "cpu")
        sync(args.device)
        start = time.perf_counter() - t0
        tag = "graphs" if graphs else "eager"
        rec = {"mode": tag, "dtype": dtype, "start_s": round(start, 2), "max_total_tokens": runner.max_total_tokens,
               "graphs": len(getattr(runner.graph_runner, "graphs", None) or {})}
        for bs in sizes:
            prompts = prompts_of[bs]
            greedy_generate(runner, prompts, 4)  # warm-up
            sync(args.device)
            t0 = time.perf_counter()
            toks = greedy_generate(runner, prompts, new)
            sync(args.device)
            dt = time.perf_counter() - t0
            rec[f"bs{bs}_tok_s"] = round(bs * new / dt, 1)
            rec[f"bs{bs}_step_ms"] = round(1000 * dt / new, 2)
            tokens[(tag, bs)] = toks
        out.append(rec)
        del runner
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    agree = {}
    for bs in sizes:
        a, b = tokens[("graphs", bs)], tokens[("eager", bs)]
        same = sum(x == y for p, q in zip(a, b) for x, y in zip(p, q))
        first = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(p)) for p, q in zip(a, b)]
        agree[f"bs{bs}"] = {"same_tokens": f"{same}/{bs * new}", "mean_first_divergence": round(sum(first) / bs, 1)}
    out.append({"mode": "graphs_vs_eager_tokens", **agree})
    return out


async def closed_loop(base: str, concurrency: int, n_requests: int, max_tokens: int) -> dict:
    import httpx

    prompts = [f"Write a long story about topic number {i} and the people in it." for i in range(n_requests)]
    ttfts, tokens = [], []
    queue = list(prompts)

    async def worker(client, model):
        while queue:
            prompt = queue.pop()
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            t0 = time.perf_counter()
            first, usage = None, None
            async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                        first = time.perf_counter() - t0
                    if chunk.get("usage"):
                        usage = chunk["usage"]
            ttfts.append(first if first is not None else float("nan"))
            tokens.append(usage["completion_tokens"] if usage else 0)

    async with httpx.AsyncClient(timeout=300) as client:
        model = (await client.get(f"{base}/v1/models")).json()["data"][0]["id"]
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client, model) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"c": concurrency, "requests": n_requests, "tokens": sum(tokens), "tok_s": round(sum(tokens) / wall, 1),
            "mean_ttft_ms": round(1000 * sum(ttfts) / len(ttfts), 1), "all_full": all(t == max_tokens for t in tokens)}


def wait_healthy(proc, base: str, log_path: str, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode}: {open(log_path).read()[-2000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"serve not healthy after {timeout} s: {open(log_path).read()[-2000:]}")


def serve_cmd(path: str, args, port: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "fleetserve.cli", "serve", "--model-path", path, "--device", args.device,
            "--port", str(port), "--log-level", "info", *extra]


def part_serve(args) -> list[dict]:
    path = build_smol_shaped(args)
    out = []
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    loads = [(1, 8), (8, 32)] if args.quick else [(1, 12), (8, 48), (32, 128)]
    max_tokens = 8 if args.quick else 64
    extras = [("graphs", [])] + ([] if args.device == "cpu" else [("eager", ["--disable-cuda-graph"])])
    if args.device == "cpu":
        extras[0][1].extend(["--max-total-tokens", "8192"])
    for i, (tag, extra) in enumerate(extras):
        port = 30300 + i
        log_path = os.path.join(args.work, f"serve_{tag}.log")
        with open(log_path, "w") as log:
            t0 = time.perf_counter()
            proc = subprocess.Popen(serve_cmd(path, args, port, extra), stdout=log, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)
            try:
                base = f"http://127.0.0.1:{port}"
                wait_healthy(proc, base, log_path, 150)
                rec = {"mode": tag, "healthy_after_s": round(time.perf_counter() - t0, 1)}
                for c, n in loads:
                    rec[f"c{c}"] = asyncio.run(closed_loop(base, c, n, max_tokens))
                lines = [ln.strip() for ln in open(log_path) if "captured" in ln or "KV cache" in ln]
                rec["log"] = [ln[-200:] for ln in lines[:3]]
                out.append(rec)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
    return out


def part_nccl(args) -> dict:
    rec = {}
    if args.device.startswith("cuda"):
        import torch.distributed as dist

        from fleetserve.distributed.groups import default_backend

        backend = default_backend(args.device)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")
        torch.cuda.set_device(0)
        dist.init_process_group(backend, rank=0, world_size=1, device_id=torch.device("cuda:0"))
        x = torch.arange(4, dtype=torch.float32, device="cuda:0")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        rec.update(backend=backend, all_reduce=x.tolist())
        dist.destroy_process_group()
    # several ranks, one GPU: refused before any rank starts
    p = subprocess.run([sys.executable, "-m", "fleetserve.cli", "serve", "--device", args.device, "--tp-size", "2",
                        "--port", "30399"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")})
    rec["tp2_exit"] = p.returncode
    rec["tp2_stderr_tail"] = p.stderr.strip().splitlines()[-1:] if p.stderr.strip() else []
    return rec


def part_profile(args) -> list[dict]:
    """Eager steps of the SmolLM2-shaped model under each CUDA attention mode
    (:data:`fleetserve.layers.attention.CUDA_SDPA_MODES`): ms per DECODE step at batch 1
    and 64 with the default (memory-sized) KV pool and a 64 K-token one, ms of one
    200-token EXTEND, and the largest logit difference from mode ``auto``. Sets
    ``FLEETSERVE_CUDA_SDPA`` to the fastest mode at batch 1 for the parts after it, and
    writes the torch.profiler tables of its batch-1 step to ``<out>.profile.txt``."""
    from torch.profiler import ProfilerActivity, profile

    from fleetserve.engine.model_runner import ModelRunner
    from fleetserve.layers.attention import CUDA_SDPA_MODES
    from helpers.batch_driver import Req, free, run_decode, run_extend

    path = build_smol_shaped(args)
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    out, ref = [], {}
    for mode in CUDA_SDPA_MODES:
        os.environ["FLEETSERVE_CUDA_SDPA"] = mode
        for pool in (None, 65536):
            runner = ModelRunner(path, dtype=dtype, max_total_tokens=pool if args.device != "cpu" else 32768,
                                 device=args.device, show_progress=False, disable_cuda_graph=True)
            rec = {"sdpa": mode, "pool_tokens": runner.max_total_tokens}
            for bs in (1, 64):
                reqs = [Req([]) for _ in range(bs)]
                sync(args.device)
                t0 = time.perf_counter()
                run_extend(runner, reqs, [[5 + i] * 200 for i in range(bs)])
                sync(args.device)
                rec[f"bs{bs}_extend200_ms"] = round(1000 * (time.perf_counter() - t0), 2)
                for _ in range(3):
                    lg = run_decode(runner, reqs, [7] * bs)
                key = (pool, bs)
                if mode == "auto":
                    ref[key] = lg.float().cpu()
                else:
                    rec[f"bs{bs}_max_logit_diff_vs_auto"] = round((lg.float().cpu() - ref[key]).abs().max().item(), 4)
                sync(args.device)
                t0 = time.perf_counter()
                for _ in range(16):
                    run_decode(runner, reqs, [7] * bs)
                sync(args.device)
                rec[f"bs{bs}_step_ms"] = round(1000 * (time.perf_counter() - t0) / 16, 2)
                if bs == 1 and pool is None and mode != "auto":
                    with profile(activities=acts) as prof:
                        for _ in range(3):
                            run_decode(runner, reqs, [7] * bs)
                        sync(args.device)
                    with open(f"{args.out}.profile_{mode}.txt", "w") as f:
                        for sort in ("self_cuda_time_total", "self_cpu_time_total"):
                            if sort.startswith("self_cuda") and len(acts) == 1:
                                continue
                            f.write(prof.key_averages().table(sort_by=sort, row_limit=20) + "\n")
                free(runner, reqs)
            out.append(rec)
            del runner
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    best = min((r for r in out if r["pool_tokens"] == out[0]["pool_tokens"]), key=lambda r: r["bs1_step_ms"])
    os.environ["FLEETSERVE_CUDA_SDPA"] = best["sdpa"]
    out.append({"chosen_for_later_parts": best["sdpa"]})
    return out


PARTS = {"env": part_env, "parity": part_parity, "decode": part_decode, "serve": part_serve, "nccl": part_nccl, "profile": part_profile}


# ---------------------------------------------------------------- report
def _table(rows: list[dict], cols: list[str]) -> list[str]:
    head = "| " + " | ".join(cols) + " |"
    lines = [head, "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    return lines


def render_markdown(recs: list[dict]) -> str:
    """Markdown tables of one run's records (one table per part; errors as a line each)."""
    lines: list[str] = []
    for r in recs:
        part, res = r["part"], r.get("result")
        lines.append(f"**{part}** ({r.get('seconds')} s)")
        lines.append("")
        if res is None:
            lines.append(f"error: `{r.get('error')}`")
        elif part == "parity":
            rows = [{"model": x["model"], "graphs captured": x["graphs_graphs_captured"],
                     "max diff extend": f"{x['graphs_max_diff']['extend']:.1e}",
                     "max diff decode (graphs)": f"{x['graphs_max_diff']['decode']:.1e}",
                     "max diff decode (eager)": f"{x['eager_max_diff']['decode']:.1e}",
                     "greedy graphs == eager": x["greedy_graphs_equal_eager"],
                     "greedy == transformers": x["greedy_equal_transformers"]} for x in res]
            lines += _table(rows, list(rows[0]))
        elif part == "decode":
            runs = [x for x in res if "dtype" in x]
            sizes = sorted(int(k[2:-6]) for k in runs[0] if k.startswith("bs") and k.endswith("_tok_s"))
            rows = [{"mode": x["mode"], "start s": x["start_s"], "graphs": x["graphs"],
                     **{f"bs {b} tok/s (ms/step)": f"{x[f'bs{b}_tok_s']} ({x[f'bs{b}_step_ms']})" for b in sizes}}
                    for x in runs]
            agree = next(x for x in res if x["mode"] == "graphs_vs_eager_tokens")
            rows.append({"mode": "same greedy tokens", **{f"bs {b} tok/s (ms/step)": agree[f"bs{b}"]["same_tokens"]
                                                          for b in sizes}})
            lines += _table(rows, list(rows[0]))
        elif part == "serve":
            rows = []
            for x in res:
                for key in sorted((k for k in x if k.startswith("c") and k[1:].isdigit()), key=lambda k: int(k[1:])):
                    v = x[key]
                    rows.append({"mode": x["mode"], "concurrency": v["c"], "requests": v["requests"],
                                 "output tok/s": v["tok_s"], "mean TTFT ms": v["mean_ttft_ms"],
                                 "all 64 tokens": v["all_full"], "healthy after s": x["healthy_after_s"]})
            lines += _table(rows, list(rows[0]))
        elif part == "profile":
            rows = [x for x in res if "sdpa" in x]
            cols = list(dict.fromkeys(c for x in rows for c in x))
            lines += _table(rows, cols)
            lines += ["", f"chosen: `{res[-1].get('chosen_for_later_parts')}`"]
        else:
            lines.append(f"`{json.dumps(res)}`")
        lines.append("")
    return "\n".join(lines)


def render(paths: list[str], intro: str = "") -> None:
    """Write docs/benchmarks.md's section from one or more results files (one subsection each)."""
    from doc_section import write_section

    body = [intro] if intro else []
    for i, path in enumerate(paths, 1):
        recs = [json.loads(ln) for ln in open(path) if ln.strip()]
        body += [f"### Run {i}: `{os.path.basename(os.path.dirname(os.path.abspath(path)))}`", "",
                 render_markdown(recs)]
    write_section("engine-cuda-check", "Engine on CUDA (benchmarks/cuda_check.py)",
                  "python benchmarks/cuda_check.py --tokenizer-dir DIR --out results.jsonl; "
                  "python benchmarks/cuda_check.py --render results.jsonl [--intro FILE]", "\n".join(body))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokenizer-dir", help="SmolLM2's tokenizer directory (tokenizer.json + config + template)")
    ap.add_argument("--out", default="cuda_check.jsonl")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--quick", action="store_true", help="small sizes (for --device cpu)")
    ap.add_argument("--render", metavar="JSONL", nargs="+", help="write docs/benchmarks.md's section from results files")
    ap.add_argument("--intro", metavar="FILE", help="with --render: markdown put before the tables")
    args = ap.parse_args()
    if args.render:
        render(args.render, open(args.intro).read().strip() if args.intro else "")
        return
    if args.tokenizer_dir is None:
        from fleetserve.models.tokenizer import tokenizer_dir

        args.tokenizer_dir = tokenizer_dir()
    args.work = args.work or tempfile.mkdtemp(prefix="cuda_check-")
    for name in args.parts.split(","):
        t0 = time.perf_counter()
        try:
            res = PARTS[name](args)
            record(args.out, name, seconds=round(time.perf_counter() - t0, 1), result=res)
        except Exception as e:  # record and go on: every part is independent
            record(args.out, name, seconds=round(time.perf_counter() - t0, 1), error=f"{type(e).__name__}: {e}",
                   trace=traceback.format_exc()[-1500:])


if __name__ == "__main__":
    main()
