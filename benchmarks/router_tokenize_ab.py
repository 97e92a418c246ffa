"""CPU µs per prompt of the router's fast encoder on the stick's bodies, and on bodies that keep only their prefix.

    PYTHONPATH=src python benchmarks/router_tokenize_ab.py BODIES.jsonl [LABEL]

Run it once per source tree (``PYTHONPATH=<other>/src``), alternately, to compare two versions.
``stick``: the stick's 200 bodies, warm (every body seen before; best of 5 passes).  ``prefix+new``:
each body's first ~600 characters (its group's shared prefix on the stick) then 130 words drawn
anew each pass (words seen before, in an order never seen), best of 5 passes.  Prints one line.
"""

import json
import random
import sys
import time

from fleetserve.models.tokenizer import tokenizer_dir
from fleetserve.router.kv_events.tokenize import RouterTokenizer


def main() -> None:
    prompts = [json.loads(line)["prompt"] for line in open(sys.argv[1]) if line.strip()]
    label = sys.argv[2] if len(sys.argv) > 2 else "this tree"
    tok = RouterTokenizer(tokenizer_dir())
    enc = tok.fast.encode
    for p in prompts:
        enc(p)
    rng = random.Random(3)
    words = [w for p in prompts for w in p.split(" ")][:5000]
    stick = fresh = float("inf")
    for _ in range(5):
        t0 = time.process_time()
        for p in prompts:
            enc(p)
        stick = min(stick, (time.process_time() - t0) / len(prompts) * 1e6)
        novel = [p[:600].rsplit(" ", 1)[0] + " " + " ".join(rng.choices(words, k=130)) for p in prompts]
        t0 = time.process_time()
        for p in novel:
            enc(p)
        fresh = min(fresh, (time.process_time() - t0) / len(novel) * 1e6)
        assert all(enc(p) == tok.tokenizer.encode(p).ids for p in novel[:20])
    print(f"{label}: stick {stick:.1f} us, prefix+new {fresh:.1f} us per prompt")


if __name__ == "__main__":
    main()
