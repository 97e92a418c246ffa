"""Output tokens/s of JSON-schema requests against the same requests unconstrained (SmolLM2, CPU).

One run, the offline ``fleetserve.Engine`` (the same scheduler and sampler as
``fleetserve serve``), greedy, ``ignore_eos`` off:

* concurrency 1: ``--requests-c1`` requests one after the other;
* concurrency 32: 32 requests submitted together (one ``generate`` call, so they
  decode as one batch).

Each row runs the unconstrained requests and then the same prompts with a JSON
schema (the grammar compiled and cached by a warm-up request first, so the
table shows the decode cost; the cold compile time is reported apart). Output
tokens/s counts each request's own tokens; constrained requests stop when their
JSON closes, so both sides are also given as tokens per request.

Usage::

    python benchmarks/structured_throughput.py           # writes its section of docs/benchmarks.md
    python benchmarks/structured_throughput.py --quick   # fewer tokens, prints only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string"},
        "interests": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["name", "age", "city", "interests"],
    "additionalProperties": False,
}
TEMPLATE = "<|im_start|>user\nDescribe person number {i} as a JSON object.<|im_end|>\n<|im_start|>assistant\n"


def run(engine, prompts, sp, concurrency):
    t0 = time.perf_counter()
    outs = []
    if concurrency == 1:
        for p in prompts:
            outs.append(engine.generate(p, sp))
    else:
        outs = engine.generate(prompts, sp)
    dt = time.perf_counter() - t0
    toks = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return toks, dt, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--requests-c1", type=int, default=4)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.max_new_tokens, args.requests_c1 = 24, 2

    import fleetserve

    engine = fleetserve.Engine()
    free = {"temperature": 0, "max_new_tokens": args.max_new_tokens}
    con = {**free, "json_schema": json.dumps(SCHEMA)}
    t0 = time.perf_counter()
    engine.generate("warm up", {**con, "max_new_tokens": 1})  # builds the tokenizer view, compiles, caches
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.generate("warm up", {**con, "max_new_tokens": 1, "json_schema": json.dumps({**SCHEMA, "title": "x"})})
    new_schema = time.perf_counter() - t0
    rows, valid = [], 0
    for c in (1, 32):
        prompts = [TEMPLATE.format(i=i) for i in range(args.requests_c1 if c == 1 else 32)]
        ft, fdt, _ = run(engine, prompts, free, c)
        ct, cdt, outs = run(engine, prompts, con, c)
        for o in outs:
            if o["meta_info"]["finish_reason"]["type"] == "stop":
                json.loads(o["text"])
                valid += 1
        rows.append((c, len(prompts), ft / fdt, ft / len(prompts), ct / cdt, ct / len(prompts),
                     (ct / cdt) / (ft / fdt)))
    lines = ["| concurrency | requests | free tok/s | free tok/req | JSON-schema tok/s | schema tok/req | ratio |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.1f} | {r[5]:.1f} | {r[6]:.2f} |")
    lines += ["", f"First constrained request of the engine (tokenizer view + compile + 1 token): {first:.2f} s; "
              f"a new schema afterwards (compile + 1 token): {new_schema * 1e3:.0f} ms. "
              f"Constrained outputs that closed their JSON all parsed ({valid}); the rest hit max_new_tokens="
              f"{args.max_new_tokens}. 1-minute load average at the end: {os.getloadavg()[0]:.1f} "
              f"(shared machine)."]
    body = "\n".join(lines)
    print(body)
    if not args.quick:
        from doc_section import write_section

        write_section("structured-throughput", "Structured outputs: JSON-schema vs free decoding (SmolLM2, CPU)",
                      f"python benchmarks/structured_throughput.py --max-new-tokens {args.max_new_tokens}", body)


if __name__ == "__main__":
    main()
