"""The scheduler's side of constrained decoding, kept out of scheduler.py.

:class:`GrammarQueue` holds requests whose grammar is compiling (they hold no
batch slot and no KV) and moves them to the scheduler's waiting queue when
their matcher is ready; :func:`advance` / :func:`finished` follow each sampled
token. The sampler applies the masks (:mod:`fleetserve.engine.sampler`).
"""

from __future__ import annotations

from typing import Any

from fleetserve.engine.grammar.backend import GrammarBackend, accept_token, is_finished
from fleetserve.engine.grammar.manager import GrammarManager
from fleetserve.engine.grammar.spec import grammar_key

# How long an otherwise idle scheduler step waits for a compilation to finish.
IDLE_WAIT_S = 0.005


def default_backend_factory(scheduler: Any):
    """Backend over the model's own tokenizer (``runner.model_path``; None = the built-in model)."""

    def make() -> GrammarBackend:
        from fleetserve.models.tokenizer import load_tokenizer

        tok = load_tokenizer(getattr(scheduler.runner, "model_path", None))
        return GrammarBackend(tok, scheduler.vocab_size, sorted(scheduler.eos_ids))

    return make


def attn_tp_size(args: Any) -> int:
    """Ranks that run one request together (they must admit it on the same step)."""
    tp = int(getattr(args, "tp_size", 1) or 1)
    if getattr(args, "enable_dp_attention", False):
        tp //= max(1, int(getattr(args, "dp_size", 1) or 1))
    return tp


class GrammarQueue:
    """Requests waiting for their grammar, for one :class:`~fleetserve.engine.scheduler.Scheduler`.

    ``backend_factory`` (settable before the first grammar request) builds the
    :class:`GrammarBackend`; by default over the model's tokenizer.
    """

    def __init__(self, scheduler: Any):
        self.scheduler = scheduler
        self.backend_factory = default_backend_factory(scheduler)
        self._manager: GrammarManager | None = None

    @property
    def manager(self) -> GrammarManager:
        if self._manager is None:
            self._manager = GrammarManager(self.backend_factory, sync=attn_tp_size(self.scheduler.args) > 1)
        return self._manager

    def pending(self) -> int:
        return len(self._manager.pending) if self._manager is not None else 0

    def admit_later(self, req: Any) -> bool:
        """Start compiling ``req``'s grammar; False when it has none (queue it at once)."""
        key = grammar_key(req.sampling)
        if key is None or req.grammar is not None:
            return False
        self.manager.submit(req, key)
        return True

    def admit_ready(self) -> list:
        """Queue the requests whose matcher is ready; the finished (abort) outputs of failed grammars."""
        if not self.pending():
            return []
        ready, failed = self.manager.take_ready()
        self.scheduler.waiting.extend(ready)
        outs = []
        for req, message in failed:
            req.finish_reason = {"type": "abort", "message": message}
            outs.append(self.scheduler._make_output(req))
        return outs

    def remove(self, rid: str) -> Any | None:
        return self._manager.remove(rid) if self._manager is not None else None

    def wait_idle(self) -> None:
        if self._manager is not None:
            self._manager.wait(IDLE_WAIT_S)


def advance(req: Any, token: int) -> None:
    """Feed the sampled ``token`` to ``req``'s matcher; a refused token is remembered as an error."""
    if not accept_token(req.grammar, token):
        req.extra["grammar_error"] = f"the grammar refused token {token}: {req.grammar.get_error()}"


def finished(req: Any) -> bool:
    """The grammar ends the request: it is complete (EOS consumed, nothing more allowed) or it failed."""
    return "grammar_error" in req.extra or is_finished(req.grammar)


def finish_reason(req: Any, token: int) -> dict:
    if "grammar_error" in req.extra:
        return {"type": "abort", "message": req.extra["grammar_error"]}
    return {"type": "stop", "matched": None}  # the grammar, not a stop token, ended it: keep its text
