"""How far each ``--quantization`` mode moves the built-in SmolLM2's output from float32's.

For every mode one in-process engine (the real scheduler + model runner, as
``benchmarks/quant_throughput.py``) runs:

* **Greedy continuations**: 32 fixed prompts, 64 tokens each (``ignore_eos``, all 32 in
  flight), compared with float32's token by token.
  ``prefix agreement`` = (sum over prompts of the number of leading tokens equal to float32's,
  i.e. up to the first divergence) / (prompts x tokens). ``overall agreement`` = share of
  all (prompt, position) pairs whose token equals float32's at that position (after a
  divergence the two texts go their own ways, so matches there are partly luck).
  ``first divergence`` = median over prompts of the 0-based position of the first
  differing token (64 = none).
* **Teacher-forced NLL**: one fixed English text (``TEXT``) fed as a prompt with prompt
  logprobs from position 0 (``return_logprob``, ``logprob_start_len=0``, top-1 logprob);
  ``NLL`` = mean over its tokens (from the 2nd) of ``-log p(token | prefix)`` in nats;
  ``vs float32`` = NLL / float32's NLL - 1. ``top-1 = float32`` = share of positions whose
  most likely next token equals float32's (no divergence: every position sees the same
  prefix).

Aims (issue 16): NLL within 2% of float32's and agreement >= 95%.

Usage::

    python benchmarks/quant_quality.py                 # all modes, writes docs/benchmarks.md
    python benchmarks/quant_quality.py --modes none,int8wo --no-write
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quant_throughput import closed_loop  # noqa: E402

#: Every ``--quantization`` value (``w8a8_int8`` is an alias of ``int8``) and one benchmark-only variant.
MODES = ("none", "fp16_weight", "bf16_linear", "int8", "int8wo", "int4wo-32", "int4wo-64", "int4wo-128", "int4wo-256", "auto",
         "int8-plain")

#: 32 prompts: instructions, facts, code and plain continuations.
PROMPTS = [
    "The capital of France is", "Once upon a time, in a small village by the sea,",
    "Write a haiku about autumn leaves.", "def fibonacci(n):", "The three primary colors are",
    "Explain photosynthesis to a ten-year-old.", "Translate to French: Good morning, how are you?",
    "List five fruits that are red.", "The theory of relativity was proposed by",
    "import numpy as np\n\ndef normalize(v):", "A recipe for pancakes needs",
    "Why is the sky blue?", "The largest planet in our solar system is",
    "Give three tips for a job interview.", "In 1969, the first humans", "SELECT name FROM users WHERE",
    "Summarize the plot of Romeo and Juliet.", "Water boils at", "My favourite book is",
    "How do I reverse a list in Python?", "The quick brown fox", "Describe a cat to someone who has never seen one.",
    "The French Revolution began in", "What are the benefits of regular exercise?", "Dear hiring manager,",
    "The human heart has four chambers:", "Write a short poem about the moon.", "To make a paper airplane, first",
    "The difference between weather and climate is", "Q: What is 12 times 12?\nA:",
    "Mount Everest is located in", "A good password should",
]

#: The teacher-forced text (this project's own prose, ~250 tokens).
TEXT = (
    "The river rose slowly through the night, and by morning the lower fields were under water. "
    "Farmers gathered on the bridge to watch the brown current carry branches, fence posts and, "
    "once, a wooden chair. Nobody spoke much. The older ones remembered the flood of their "
    "childhood, when the water had reached the church steps and the school had closed for a month. "
    "This time the weather service had warned them three days ahead, so the animals were already "
    "on the hill and the grain had been moved to the barns on higher ground. By noon the rain "
    "stopped. The sun came out over the valley, and the water, still high, began to shine. "
    "Children ran along the road to see how far it had come, and their parents called them back. "
    "In the evening the mayor walked from house to house with a list, asking who needed help with "
    "pumps, who had lost stores, and who could lend a boat. Most people said they were fine. "
    "A week later the fields were mud, the ditches were full of sand, and the work of clearing them "
    "had begun. It would take the whole summer, but the harvest, planted late, would still come in."
)


def teacher_forced(sched, ids: list[int], tag: str) -> tuple[list[float], list[int]]:
    """(per-position logprob of the text's token, per-position argmax token) for positions 1..n-1."""
    from fleetserve.engine.io_struct import TokenizedGenerateReq
    from fleetserve.engine.sampling_params import SamplingParams

    rid = f"{tag}-nll"
    sched.add_request(TokenizedGenerateReq(rid, ids, SamplingParams(max_new_tokens=1, temperature=0.0),
                                           return_logprob=True, top_logprobs_num=1, logprob_start_len=0))
    lps, tops = None, None
    for _ in range(100000):
        for o in sched.step():
            if o.rid == rid and o.input_logprobs is not None:
                lps = [lp for lp, _ in o.input_logprobs[1:]]
                tops = [t[0][1] for t in o.input_top_logprobs[1:]]
            if o.rid == rid and o.finished:
                assert lps is not None, "no prompt logprobs came back"
                return lps, tops
    raise RuntimeError("teacher-forced request did not finish")


def agreement(ref: dict[int, list[int]], outs: dict[int, list[int]]) -> tuple[float, float, float]:
    """(prefix agreement, overall agreement, median first-divergence position) against ``ref``."""
    prefix, same, total, firsts = 0, 0, 0, []
    for i, r in ref.items():
        o = outs[i]
        k = next((j for j, (x, y) in enumerate(zip(r, o)) if x != y), min(len(r), len(o)))
        prefix += k
        firsts.append(k)
        same += sum(x == y for x, y in zip(r, o))
        total += len(r)
    return prefix / total, same / total, statistics.median(firsts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--section", default="quant_quality",
                    help="docs/benchmarks.md section to (re)write (a new name is appended at the end)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    from fleetserve.models.registry import default_model_path
    from fleetserve.models.tokenizer import load_tokenizer
    from quant_modes import build

    modes = a.modes.split(",")
    if modes[0] != "none":
        modes = ["none"] + [m for m in modes if m != "none"]
    tok = load_tokenizer(default_model_path())
    prompt_ids = [tok.encode(p) for p in PROMPTS[: a.prompts]]
    text_ids = tok.encode(TEXT)
    t0 = time.perf_counter()
    sched, switch = build(modes)  # one model, every mode's linears ready (quant_modes.py)
    print(f"model loaded, {len(modes)} modes ready in {time.perf_counter() - t0:.0f} s", flush=True)
    def report(final: bool) -> None:
        ref_outs, ref_lps, ref_tops = res["none"]
        ref_nll = -sum(ref_lps) / len(ref_lps)
        rows = []
        for mode in [m for m in modes if m in res]:
            outs, lps, tops = res[mode]
            pa, oa, fd = agreement(ref_outs, outs)
            nll = -sum(lps) / len(lps)
            top1 = sum(x == y for x, y in zip(ref_tops, tops)) / len(ref_tops)
            rows.append((mode, pa, oa, fd, nll, nll / ref_nll - 1, top1))
            if final:
                print(f"{mode:>11}: prefix {pa:.1%} overall {oa:.1%} first div {fd:.0f}  NLL {nll:.4f} "
                      f"({nll / ref_nll - 1:+.2%}) top-1 {top1:.1%}", flush=True)
        body = (f"torch {torch.__version__}, {a.threads} threads, CPU capability "
                f"{torch.backends.cpu.get_cpu_capability()}. Greedy: {len(prompt_ids)} prompts x "
                f"{a.max_new_tokens} tokens (ignore_eos, all in flight). Teacher-forced: one fixed text of "
                f"{len(text_ids)} tokens (`TEXT` in the script). Definitions in the script's docstring: "
                "prefix agreement = tokens equal to float32's up to each prompt's first divergence / all tokens; "
                "overall = tokens equal to float32's at the same position / all tokens; first divergence = "
                "median position of the first differing token; NLL in nats per token; top-1 = share of "
                "teacher-forced positions whose argmax equals float32's. Aim: NLL within 2%, agreement >= 95%. "
                "`int8-plain` (one activation scale per call, no smoothing: the int8 before SmoothQuant), "
                "`int8-smooth` (SmoothQuant only) and `int8-token` (per-token scales only) are benchmark-only "
                "variants of `int8` (`benchmarks/quant_modes.py`).\n\n"
                "| --quantization | prefix agreement | overall agreement | first divergence (median) "
                "| NLL | NLL vs float32 | teacher-forced top-1 = float32 |\n|---|---|---|---|---|---|---|\n")
        body += "\n".join(f"| {m} | {pa:.1%} | {oa:.1%} | {fd:.0f} | {nll:.4f} | {d:+.2%} | {t:.1%} |"
                          for m, pa, oa, fd, nll, d, t in rows) + "\n"
        if not final:
            body += (f"\nPartial: {len(res)} of {len(modes)} modes done so far "
                     f"(not yet: {', '.join(m for m in modes if m not in res)}).\n")
        body += f"\nMachine load average at the end: {' / '.join(f'{x:.1f}' for x in os.getloadavg())} (1 / 5 / 15 min).\n"
        if final:
            print(body)
        if not a.no_write:
            from doc_section import write_section

            write_section(a.section, "Output quality by --quantization (SmolLM2, CPU)",
                          " ".join(["python benchmarks/quant_quality.py"] + sys.argv[1:]), body)
    res = {}
    for mode in modes:
        t0 = time.perf_counter()
        switch.use(mode)
        sched.flush_cache()
        _, _, outs = closed_loop(sched, prompt_ids, len(prompt_ids), a.max_new_tokens, mode)
        sched.flush_cache()
        lps, tops = teacher_forced(sched, text_ids, mode)
        res[mode] = (outs, lps, tops)
        pa, oa, fd = agreement(res["none"][0], outs)
        nll, ref_nll = -sum(lps) / len(lps), -sum(res["none"][1]) / len(res["none"][1])
        print(f"{mode}: done in {time.perf_counter() - t0:.0f} s: prefix {pa:.1%} overall {oa:.1%} "
              f"first div {fd:.0f} NLL {nll:.4f} ({nll / ref_nll - 1:+.2%})", flush=True)
        if mode != modes[-1]:
            report(False)  # the section so far, in case a slow mode does not finish
    report(True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
