"""The ``engine_systems`` section of ``benchmarks/engine_throughput.py``: fleetserve vs transformers vs llama.cpp.

One run, the same prompts for every system, greedy, ``ignore_eos``:

* ``fleetserve serve`` once per ``--quantization`` mode (``none`` = float32,
  ``int8``, ``fp16_weight``), each a real server process over HTTP;
* llama.cpp's ``llama-server`` on the same GGUF (``--llama-server PATH``;
  skipped with a note when absent), ``--parallel`` = the highest concurrency;
* transformers ``generate`` in this process on batches of ``c`` prompts (no
  server; its TTFT is the batch's prefill time, as in the section above).

All servers are started first and stay up (idle ones sleep); at each level the
systems take turns (the order rotates level by level) so that load from other
jobs on a shared machine falls on all of them alike. Every system gets the same
number of threads. Levels: concurrency 1, 8, 32 (``--concurrency``), with equal
output lengths (``--max-new-tokens`` each) and mixed ones (seeded, uniform in
``--mixed-output-range``). The table gives output tokens/s and mean TTFT, with
ratios to fleetserve float32 and to llama.cpp at the same level.
"""

from __future__ import annotations

import os
import platform
import random
import signal
import sys
import time

import torch

import serving_systems as ss

MODES = ("none", "int8", "fp16_weight")  # the default --systems-quantization; any mode (+compile) runs
MODE_LABEL = {"none": "fleetserve float32 (--quantization none)", "int8": "fleetserve --quantization int8",
              "fp16_weight": "fleetserve --quantization fp16_weight"}


def threads_note(args) -> str:
    return f"{args.threads} threads (`n_threads` = `n_threads_batch`), KV unified, `n_batch` 512."


def mode_flags(mode: str) -> tuple[str, list[str]]:
    """``--systems-quantization`` entry -> (``--quantization`` value, more serve flags):
    ``MODE+compile`` adds ``--enable-torch-compile`` (e.g. ``bf16_linear+compile``)."""
    quant, _, rest = mode.partition("+")
    if rest not in ("", "compile"):
        raise SystemExit(f"--systems-quantization: unknown suffix {rest!r} in {mode!r} (only +compile)")
    return quant, (["--enable-torch-compile"] if rest == "compile" else [])


def _levels(spec: str) -> list[int]:
    return [int(x) for x in spec.split(",") if x.strip()]


def _requests(spec: str, levels: list[int], default) -> list[int]:
    if spec:
        n = [int(x) for x in spec.split(",")]
        if len(n) != len(levels):
            raise SystemExit(f"--systems-requests: need one count per --concurrency level ({len(levels)})")
        return n
    return [default(c) for c in levels]


def run(args, path: str, tok, prompts_for, run_hf) -> str:
    """Run every system at every level; returns the section's markdown (also printed as it goes)."""
    from transformers import AutoModelForCausalLM

    threads = args.threads
    levels = _levels(args.concurrency)
    n_equal = _requests(args.systems_requests, levels, lambda c: max(4, min(2 * c, 32)))
    n_mixed = _requests(args.systems_mixed_requests, levels, lambda c: max(4, min(2 * c, 48)))
    lo, hi = (int(x) for x in args.mixed_output_range.split(","))
    modes = [m for m in args.systems_quantization.split(",") if m]

    torch.set_num_threads(threads)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below: stop the servers
    servers: dict[str, ss.Server] = {}
    notes: list[str] = []
    try:
        for m in modes:  # all start together, and while transformers loads here
            quant, extra = mode_flags(m)
            print(f"starting fleetserve --quantization {quant} {' '.join(extra)}", flush=True)
            servers[m] = ss.fleetserve_server(path, quant, threads, wait=False, extra_args=extra)
        hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                  dtype=torch.float32).eval()
        for srv in servers.values():
            ss.wait_ready(srv)
        llama = ss.llama_server(args.llama_server, path, threads, parallel=max(levels),
                                ctx_per_slot=args.llama_ctx_per_slot)
        if llama is not None:
            servers["llama.cpp"] = llama
            print(f"llama-server up: {llama.version}", flush=True)
        batched = args.llama_batched if args.llama_batched and os.access(args.llama_batched, os.X_OK) else ""
        if llama is None and not batched:
            notes.append(f"llama.cpp column skipped: no llama-server binary at --llama-server "
                         f"({args.llama_server or 'not given'}) and no --llama-batched driver.")
        systems = list(servers) + (["llama.cpp"] if llama is None and batched else []) + ["transformers"]
        for name, srv in servers.items():  # warm-up: first calls allocate and pick kernels
            ss.measure(srv.base, prompts_for(2), [4, 4], 2, f"warm-{name}")
        run_hf(hf, tok, prompts_for(2), 2, 4)

        rows: list[tuple[str, int, int, str, ss.Result | None]] = []
        rng = random.Random(0)
        t_start = time.perf_counter()
        for kind in ("equal", "mixed"):
            for li, c in enumerate(levels):
                n = (n_equal if kind == "equal" else n_mixed)[li]
                texts = prompts_for(n)
                lens = [args.max_new_tokens] * n if kind == "equal" else [rng.randint(lo, hi) for _ in range(n)]
                k = (li + (kind == "mixed") * len(levels)) % len(systems)
                for name in systems[k:] + systems[:k]:
                    try:
                        if name == "transformers":
                            tps, pre = run_hf(hf, tok, texts, c, lens)
                            res = ss.Result(tps, pre, n, sum(lens), 0)
                        elif name == "llama.cpp" and name not in servers:
                            res = ss.llama_batched(batched, path, threads, texts, lens, c, args.llama_ctx_per_slot)
                        else:
                            res = ss.measure(servers[name].base, texts, lens, c, f"{kind}{c}-{name}")
                    except RuntimeError as e:
                        print(f"{name} {kind} c={c}: FAILED {e}", flush=True)
                        notes.append(f"{name}, {kind} lengths, c={c}: failed ({str(e).splitlines()[0][:200]}).")
                        res = None
                    rows.append((kind, c, n, name, res))
                    if res is not None:
                        print(f"{kind:>5} c={c:>3} n={n:>3} {name:>12}: {res.tps:7.1f} tok/s  TTFT "
                              f"{res.ttft * 1000:7.0f} ms  ({time.perf_counter() - t_start:.0f} s)", flush=True)
        version = servers["llama.cpp"].version if "llama.cpp" in servers else ""
        via = "server" if "llama.cpp" in servers else ("batched" if "llama.cpp" in systems else "")
    finally:
        for srv in servers.values():
            ss.stop(srv)
    return _section(args, rows, systems, version, via, notes, levels, (lo, hi))


def _label(name: str, via: str) -> str:
    if name == "llama.cpp":
        return ("llama.cpp `llama-server` (Q4_1 as is)" if via == "server"
                else "llama.cpp libllama, batched driver, no HTTP (Q4_1 as is)")
    if name in MODE_LABEL or name == "transformers":
        return MODE_LABEL.get(name, "transformers float32 `generate` (in-process, batches)")
    quant, extra = mode_flags(name)
    return f"fleetserve --quantization {quant}" + (" --enable-torch-compile" if extra else "")


def _section(args, rows, systems, version, via, notes, levels, mixed_range) -> str:
    model, flags = ss.cpu_description()
    load = os.getloadavg()
    by = {(k, c, s): r for k, c, _, s, r in rows}
    rows = sorted(rows, key=lambda x: (x[0] != "equal", x[1], systems.index(x[3])))

    def ratio(r, other) -> str:
        return f"{r.tps / other.tps:.2f}x" if r is not None and other is not None else "-"

    body = [
        f"CPU: {model} ({platform.machine()}), {os.cpu_count()} cores; SIMD flags: {', '.join(flags) or 'none'}; "
        f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}. "
        f"Machine load average at the end: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min): the "
        f"cores were shared with other jobs, so absolute figures are noisy; the systems took turns at each "
        f"level (rotating order), so read the ratios.",
        "",
        f"SmolLM2-135M-Instruct, the shipped GGUF (Q4_1). fleetserve dequantizes it at load and runs float32 "
        f"(or re-quantizes: int8 W8A8 / fp16 weights); llama.cpp runs the Q4_1 weights as they are. "
        f"{args.threads} threads for every system (`--torch-num-threads {args.threads}`; "
        + (f"llama-server `-t {args.threads} -tb {args.threads} --parallel {max(levels)}`; " if via == "server" else "")
        + f"transformers "
        f"`torch.set_num_threads({args.threads})`). Servers: streaming `/v1/completions`, greedy, "
        f"`ignore_eos`, closed loop with *c* requests in flight, one client (`fleetserve.bench.client`); "
        f"every request checked to return exactly its `max_tokens`; a try that got no byte of a response is "
        f"sent again (at most {ss.RETRIES} times, counted under *retries*). TTFT = request sent -> first text chunk "
        f"(transformers: the batch's prefill, `generate(max_new_tokens=1)`). Equal: {args.max_new_tokens} "
        f"output tokens each; mixed: uniform in {mixed_range[0]}..{mixed_range[1]} (seed 0), a transformers "
        f"batch running to its longest member and only each request's own tokens counted.",
        "",
    ]
    if via == "server":
        body += [f"llama.cpp: `{os.path.basename(args.llama_server)}`"
                 + (f", {args.llama_note}" if args.llama_note else "") + f"; `--version` says: `{version}`.", ""]
    elif via == "batched":
        body += ["llama.cpp: llama-server was not available, so its column is `benchmarks/llamacpp_batched.cpp` "
                 "linked against libllama: one context, one sequence per slot, new prompts and running "
                 "requests' next tokens in one `llama_decode` batch, slots refilled as requests finish (the "
                 "engine llama-server drives), greedy argmax, no HTTP, no sampler chain; TTFT from admission to "
                 f"a slot. {threads_note(args)}" + (f" Built: {args.llama_note}." if args.llama_note else ""), ""]
    body += ["| output lengths | c | requests | system | output tok/s | vs float32 | vs llama.cpp | mean TTFT ms "
             "| retries |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for kind, c, n, name, r in rows:
        base, ll = by.get((kind, c, "none")), by.get((kind, c, "llama.cpp"))
        tps = f"{r.tps:.1f}" if r else "failed"
        ttft = f"{r.ttft * 1000:.0f}" if r else "-"
        retries = str(r.retries) if r else "-"
        body.append(f"| {kind} | {c} | {n} | {_label(name, via)} | {tps} | {ratio(r, base)} | {ratio(r, ll)} | {ttft} "
                    f"| {retries} |")
    body.append("")
    # the aims
    fs = [m for m in systems if m not in ("llama.cpp", "transformers")]  # the fleetserve modes
    aims = []
    c1, cmax = min(levels), max(levels)
    ll1 = by.get(("equal", c1, "llama.cpp"))
    best1 = max((by.get(("equal", c1, m)) for m in fs if by.get(("equal", c1, m))), key=lambda r: r.tps, default=None)
    if ll1 and best1:
        name1 = next(m for m in fs if by.get(("equal", c1, m)) is best1)
        aims.append(f"at concurrency {c1}, >= 0.5x llama.cpp's tok/s: best fleetserve ({name1}) "
                    f"{best1.tps / ll1.tps:.2f}x -> **{'met' if best1.tps >= 0.5 * ll1.tps else 'not met'}**")
    else:
        aims.append(f"at concurrency {c1} vs llama.cpp: not measured")
    f32 = by.get(("equal", cmax, "none"))
    bestm = max((by.get(("equal", cmax, m)) for m in fs if m != "none" and by.get(("equal", cmax, m))),
                key=lambda r: r.tps, default=None)
    if f32 and bestm:
        namem = next(m for m in fs if by.get(("equal", cmax, m)) is bestm)
        from fleetserve.core.cpu_features import has_vnni

        # the aim depends on the CPU: 3x float32 with int8 dot products (VNNI), 1.5x without
        want, cpu = (3.0, "this VNNI CPU") if has_vnni() else (1.5, "this CPU without VNNI")
        aims.append(f"at concurrency {cmax}, >= {want:g}x float32's tok/s on {cpu}: best ({namem}) "
                    f"{bestm.tps / f32.tps:.2f}x -> **{'met' if bestm.tps >= want * f32.tps else 'not met'}**")
    body.append("Aims (issue 16, equal lengths): " + "; ".join(aims) + ".")
    if "int8" in fs:
        body += ["", "Read the int8 rows with care: W8A8 int8's greedy tokens left float32's within the first few "
                 "tokens on this model (section `quant_throughput`, column = float32), so its speed is not a "
                 "like-for-like win; fp16_weight keeps float32's tokens."]
    if notes:
        body += [""] + [f"Note: {n}" for n in notes]
    return "\n".join(body)
