"""``fleetserve.Engine``: the engine as a Python object (offline batch generation).

Like SGLang's offline ``sgl.Engine`` (and vLLM's ``LLM``)::

    import fleetserve
    engine = fleetserve.Engine()                         # built-in SmolLM2, or model_path=...
    out = engine.generate("The capital of France is", {"temperature": 0, "max_new_tokens": 8})
    out["text"], out["output_ids"], out["meta_info"]["cached_tokens"]

Single rank, in-process: the :class:`~fleetserve.engine.scheduler.Scheduler`
is stepped directly (no ZMQ, no extra process), so everything the HTTP server
does to batches happens here too: radix cache, continuous batching, chunked
prefill, retraction. Text and stop strings go through the server's own
:class:`~fleetserve.entrypoints.detokenizer.RequestDetokenizer`: when it finds a
stop string, the request is aborted on the scheduler, as the server does.
"""

from __future__ import annotations

import itertools
import uuid
from typing import Any

from fleetserve.distributed.parallel_state import SINGLE_RANK_STATE
from fleetserve.engine.args import ServerArgs
from fleetserve.engine.io_struct import ReqOutput, TokenizedGenerateReq
from fleetserve.engine.rank_builder import build_rank, make_model_runner
from fleetserve.engine.sampling_params import SamplingParams
from fleetserve.entrypoints.detokenizer import RequestDetokenizer
from fleetserve.entrypoints.validation import check_input_ids, generate_sampling_dicts, native_sampling
from fleetserve.models.tokenizer import load_tokenizer


class Engine:
    """One single-rank engine instance in this process.

    Args:
        model_path: HF directory or ``.gguf``; ``None`` = built-in SmolLM2-135M-Instruct.
        model_runner: use this runner instead of loading one (tests, benchmarks).
        tokenizer: use this tokenizer instead of loading the model's. With
            ``skip_tokenizer_init=True`` and no tokenizer, only ``input_ids`` are taken,
            ``text`` is empty and stop strings are not checked.
        **server_args: any :class:`~fleetserve.engine.args.ServerArgs` field
            (``max_total_tokens``, ``dtype``, ``chunked_prefill_size``, ``disable_radix_cache`` ...).

    Raises:
        ValueError: bad server arguments.
    """

    def __init__(self, model_path: str | None = None, *, model_runner: Any = None, tokenizer: Any = None,
                 **server_args: Any):
        self.server_args = ServerArgs(model_path=model_path, **server_args)
        args = self.server_args
        if model_runner is None:
            model_runner = make_model_runner(args, SINGLE_RANK_STATE, show_progress=True)
        self.model_runner = model_runner
        if tokenizer is None and not args.skip_tokenizer_init:
            if args.model_path is None and getattr(model_runner, "model_path", None):
                args.model_path = model_runner.model_path
            tokenizer = load_tokenizer(args.tokenizer_path or args.model_path)
        self.tokenizer = tokenizer
        self.scheduler = build_rank(args, SINGLE_RANK_STATE, runner=model_runner).scheduler
        self._ids = itertools.count()

    # ---------------------------------------------------------------- public
    def generate(self, prompt: str | list[str] | None = None,
                 sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool = False,
                 top_logprobs_num: int = 0, logprob_start_len: int = -1) -> dict[str, Any] | list[dict[str, Any]]:
        """Generate for one prompt (returns a dict) or a batch (returns a list of dicts).

        Args:
            prompt: text, or a list of texts (tokenized with the model's tokenizer).
            sampling_params: a dict of :class:`SamplingParams` fields for all prompts, or
                one dict per prompt. ``n > 1`` yields ``n`` results per prompt
                (sharing one prefill); a seeded request uses ``seed + i`` for sample ``i``.
            input_ids: token ids instead of ``prompt`` (a list, or a list of lists).
            return_logprob: return logprobs of the chosen tokens.
            top_logprobs_num: and this many top alternatives per position.
            logprob_start_len: also return prompt logprobs from this position (``-1``: none).

        Returns:
            per request ``{"text", "output_ids", "meta_info": {"id", "prompt_tokens",
            "completion_tokens", "cached_tokens", "finish_reason", and with
            ``return_logprob`` "output_token_logprobs", "output_top_logprobs",
            "input_token_logprobs", "input_top_logprobs"}}``; logprob entries are
            ``(logprob, token_id, None)`` as in SGLang. Results are ordered prompt by
            prompt, the ``n`` samples of a prompt together. A single prompt with
            ``n == 1`` returns the dict itself.

        Raises:
            ValueError: neither or both of ``prompt`` / ``input_ids``. The checks shared with
                ``POST /generate`` (:mod:`fleetserve.entrypoints.validation`) raise its
                ``APIError`` (a ValueError): a ``sampling_params`` list without one dict
                per prompt; an empty prompt; a token id that is not an int in
                ``[0, vocab_size)``; an unknown or out-of-range sampling parameter.
        """
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        single = isinstance(prompt, str) or (input_ids is not None and input_ids and isinstance(input_ids[0], int))
        if prompt is not None:
            if self.tokenizer is None:
                raise ValueError("prompt text needs a tokenizer; pass input_ids")
            texts = [prompt] if isinstance(prompt, str) else list(prompt)
            id_lists = [list(self.tokenizer.encode(t)) for t in texts]
        else:
            id_lists = [list(input_ids)] if single else [list(x) for x in input_ids]
        raw_sampling = generate_sampling_dicts(sampling_params, len(id_lists))
        vocab = self.scheduler.vocab_size
        id_lists = [check_input_ids(ids, vocab, f"prompt {k}") for k, ids in enumerate(id_lists)]
        # no context check here: the scheduler answers a prompt that does not fit with an abort
        sp_list = [native_sampling(d, prompt_len=len(ids), vocab_size=vocab, context_length=None)
                   for ids, d in zip(id_lists, raw_sampling)]

        reqs: list[TokenizedGenerateReq] = []
        for ids, sp in zip(id_lists, sp_list):
            for i in range(sp.n):
                one = SamplingParams.from_dict({**sp.to_dict(), "n": 1})
                if sp.seed is not None:
                    one.seed = sp.seed + i
                reqs.append(TokenizedGenerateReq(
                    rid=f"{uuid.uuid4().hex[:8]}-{next(self._ids)}", input_ids=ids, sampling=one,
                    return_logprob=return_logprob, top_logprobs_num=top_logprobs_num,
                    logprob_start_len=logprob_start_len if return_logprob else -1,
                    # stop strings are checked as tokens arrive, so such requests stream
                    stream=bool(one.stop) and self.tokenizer is not None))
        finals = self._run(reqs)
        results = [self._to_dict(r, finals[r.rid]) for r in reqs]
        return results[0] if single and len(results) == 1 else results

    def flush_cache(self) -> bool:
        """Empty the radix cache (only when idle)."""
        return self.scheduler.flush_cache()

    def get_stats(self):
        return self.scheduler.get_stats()

    def shutdown(self) -> None:
        """Stop the KV-event publisher if ``kv_events_config`` started one (else nothing to stop)."""
        close = getattr(self.scheduler.event_sink, "shutdown", None)
        if close is not None:
            close()

    # --------------------------------------------------------------- helpers
    def _run(self, reqs: list[TokenizedGenerateReq]) -> dict[str, dict[str, Any]]:
        acc: dict[str, dict[str, Any]] = {
            r.rid: {"ids": [], "lp": [], "top": [], "last": None, "text": "", "finish_reason": None,
                    "completion_tokens": 0,
                    "detok": RequestDetokenizer(self.tokenizer, r.sampling, trim_stop_token=True)}
            for r in reqs}

        def take(outs: list[ReqOutput]) -> None:
            for o in outs:
                a = acc.get(o.rid)
                if a is None or a["detok"].finished:  # e.g. the answer to our own abort
                    continue
                step = a["detok"].feed(o)
                a["ids"].extend(step.token_ids)
                a["text"] += step.text
                if step.output_logprobs is not None:
                    a["lp"].extend(step.output_logprobs)
                    a["top"].extend(step.output_top_logprobs or [])
                if o.input_logprobs is not None:
                    a["in_lp"], a["in_top"] = o.input_logprobs, o.input_top_logprobs
                a["last"] = o
                if step.finished:
                    a["finish_reason"] = step.finish_reason
                    a["completion_tokens"] = step.completion_tokens
                if step.abort_scheduler:  # a stop string ended it: stop generating, free the KV
                    self.scheduler.abort(o.rid)

        for r in reqs:
            take(self.scheduler.add_request(r))
        while any(not a["detok"].finished for a in acc.values()):
            if not self.scheduler.has_work():
                raise RuntimeError("scheduler went idle with unfinished requests")
            take(self.scheduler.step())
        return acc

    def _to_dict(self, req: TokenizedGenerateReq, a: dict[str, Any]) -> dict[str, Any]:
        o: ReqOutput = a["last"]
        ids: list[int] = a["ids"]
        meta: dict[str, Any] = {
            "id": req.rid,
            "prompt_tokens": o.prompt_tokens,
            "completion_tokens": a["completion_tokens"],
            "cached_tokens": o.cached_tokens,
            "finish_reason": a["finish_reason"],
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = [(lp, t, None) for lp, t in a["lp"]]
            meta["output_top_logprobs"] = [[(lp, t, None) for lp, t in top] if top is not None else None
                                           for top in a["top"]]
            meta["input_token_logprobs"] = [(lp, t, None) for lp, t in a.get("in_lp") or []]
            meta["input_top_logprobs"] = [[(lp, t, None) for lp, t in top] if top is not None else None
                                          for top in a.get("in_top") or []]
        return {"text": a["text"], "output_ids": ids, "meta_info": meta}
