"""Penalties on the real model runner (whose logits are inference-mode tensors).

Greedy decoding with a repetition penalty must equal transformers' ``generate``
with the same penalty (CTRL's rule over prompt + output), and frequency /
presence penalties must equal a reference loop over transformers' logits.
"""

import torch
from transformers import AutoModelForCausalLM

from fleetserve.engine.args import ServerArgs
from fleetserve.engine.io_struct import TokenizedGenerateReq
from fleetserve.engine.sampling_params import SamplingParams
from fleetserve.engine.scheduler import Scheduler
from helpers.scheduler_driver import run_to_completion

PROMPT = [5, 17, 23, 5, 17, 99, 42, 8, 5]
NEW = 24


def _generate(path, sp, prompt=PROMPT):
    from fleetserve.engine.model_runner import ModelRunner

    runner = ModelRunner(path, dtype="float32", max_total_tokens=256, show_progress=False)
    sched = Scheduler(ServerArgs(random_seed=0), runner, check_invariants=True)
    return run_to_completion(sched, [TokenizedGenerateReq("p", list(prompt), sp)])["p"][0]


def test_repetition_penalty_matches_transformers(tiny_llama_dir):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()

    def hf_greedy(prompt, **kw):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW,
                              do_sample=False, pad_token_id=0, **kw)
        return out[0, len(prompt):].tolist()

    # The first seeded prompt whose plain greedy output repeats a token: there the penalty must bite.
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        prompt = torch.randint(3, 250, (12,), generator=g).tolist()
        plain = hf_greedy(prompt)
        if len(set(plain)) < NEW:
            break
    assert len(set(plain)) < NEW
    ours = _generate(tiny_llama_dir, SamplingParams(max_new_tokens=NEW, temperature=0.0,
                                                    repetition_penalty=1.3, ignore_eos=True), prompt)
    assert ours == hf_greedy(prompt, repetition_penalty=1.3)
    assert ours != plain  # the penalty really changed the continuation


def test_frequency_and_presence_penalties_match_reference_loop(tiny_llama_dir):
    freq, pres = 0.7, 0.9
    sp = SamplingParams(max_new_tokens=NEW, temperature=0.0, frequency_penalty=freq,
                        presence_penalty=pres, ignore_eos=True)
    ours = _generate(tiny_llama_dir, sp)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ids, out = list(PROMPT), []
    with torch.no_grad():
        for _ in range(NEW):
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=logits.numel())[: logits.numel()]
            logits = logits - freq * counts - pres * (counts > 0).float()
            nxt = int(logits.argmax())
            out.append(nxt)
            ids.append(nxt)
    assert ours == out
