"""``fleetserve.Engine``: the engine as a Python object (offline batch generation).

Like SGLang's offline ``sgl.Engine`` (and vLLM's ``LLM``)::

    import fleetserve
    engine = fleetserve.Engine()                         # built-in SmolLM2, or model_path=...
    out = engine.generate("The capital of France is", {"temperature": 0, "max_new_tokens": 8})
    out["text"], out["output_ids"], out["meta_info"]["cached_tokens"]

Single rank, in-process: the :class:`~fleetserve.engine.scheduler.Scheduler`
is stepped directly (no ZMQ, no extra process), so everything the HTTP server
does to batches happens here too: radix cache, continuous batching, chunked
prefill, retraction.
"""

from __future__ import annotations

import itertools
import uuid
from typing import Any

from fleetserve.distributed.parallel_state import SINGLE_RANK_STATE
from fleetserve.engine.args import ServerArgs
from fleetserve.engine.io_struct import ReqOutput, TokenizedGenerateReq
from fleetserve.engine.rank_builder import build_rank, load_tokenizer_for, make_model_runner
from fleetserve.engine.sampling_params import SamplingParams


class Engine:
    """One single-rank engine instance in this process.

    Args:
        model_path: HF directory or ``.gguf``; ``None`` = built-in SmolLM2-135M-Instruct.
        model_runner: use this runner instead of loading one (tests, benchmarks).
        tokenizer: use this tokenizer instead of loading the model's.
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
            tokenizer = load_tokenizer_for(args)
        self.tokenizer = tokenizer
        self.scheduler = build_rank(args, SINGLE_RANK_STATE, runner=model_runner, tokenizer=tokenizer).scheduler
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
            ValueError: neither or both of ``prompt`` / ``input_ids``; an empty prompt; a token
                id that is not an int in ``[0, vocab_size)``; bad sampling params.
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
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(id_lists):
                raise ValueError(f"{len(sampling_params)} sampling_params for {len(id_lists)} prompts")
            sp_list = [SamplingParams.from_dict(d) for d in sampling_params]
        else:
            sp_list = [SamplingParams.from_dict(sampling_params) for _ in id_lists]
        vocab = self.scheduler.vocab_size
        for k, ids in enumerate(id_lists):
            if not ids:
                raise ValueError(f"prompt {k} is empty")
            bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {k}: token ids must be integers in [0, {vocab}), got {bad[0]!r}")
        for sp in sp_list:
            sp.verify(vocab)

        reqs: list[TokenizedGenerateReq] = []
        for ids, sp in zip(id_lists, sp_list):
            for i in range(sp.n):
                one = SamplingParams.from_dict({**sp.to_dict(), "n": 1})
                if sp.seed is not None:
                    one.seed = sp.seed + i
                reqs.append(TokenizedGenerateReq(
                    rid=f"{uuid.uuid4().hex[:8]}-{next(self._ids)}", input_ids=ids, sampling=one,
                    return_logprob=return_logprob, top_logprobs_num=top_logprobs_num,
                    logprob_start_len=logprob_start_len if return_logprob else -1))
        finals = self._run(reqs)
        results = [self._to_dict(r, finals[r.rid]) for r in reqs]
        return results[0] if single and len(results) == 1 else results

    def flush_cache(self) -> bool:
        """Empty the radix cache (only when idle)."""
        return self.scheduler.flush_cache()

    def get_stats(self):
        return self.scheduler.get_stats()

    def shutdown(self) -> None:
        """Nothing to stop (in-process); present for SGLang API compatibility."""

    # --------------------------------------------------------------- helpers
    def _run(self, reqs: list[TokenizedGenerateReq]) -> dict[str, dict[str, Any]]:
        acc: dict[str, dict[str, Any]] = {r.rid: {"ids": [], "lp": [], "top": [], "last": None} for r in reqs}

        def take(outs: list[ReqOutput]) -> None:
            for o in outs:
                a = acc.get(o.rid)
                if a is None:
                    continue
                a["ids"].extend(o.new_token_ids)
                if o.output_logprobs is not None:
                    a["lp"].extend(o.output_logprobs)
                    a["top"].extend(o.output_top_logprobs or [])
                if o.input_logprobs is not None:
                    a["in_lp"], a["in_top"] = o.input_logprobs, o.input_top_logprobs
                a["last"] = o

        for r in reqs:
            take(self.scheduler.add_request(r))
        while any(a["last"] is None or not a["last"].finished for a in acc.values()):
            if not self.scheduler.has_work():
                raise RuntimeError("scheduler went idle with unfinished requests")
            take(self.scheduler.step())
        return acc

    def _to_dict(self, req: TokenizedGenerateReq, a: dict[str, Any]) -> dict[str, Any]:
        o: ReqOutput = a["last"]
        ids: list[int] = a["ids"]
        fr = o.finish_reason
        meta: dict[str, Any] = {
            "id": req.rid,
            "prompt_tokens": o.prompt_tokens,
            "completion_tokens": o.completion_tokens,
            "cached_tokens": o.cached_tokens,
            "finish_reason": fr,
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = [(lp, t, None) for lp, t in a["lp"]]
            meta["output_top_logprobs"] = [[(lp, t, None) for lp, t in top] if top is not None else None
                                           for top in a["top"]]
            meta["input_token_logprobs"] = [(lp, t, None) for lp, t in a.get("in_lp") or []]
            meta["input_top_logprobs"] = [[(lp, t, None) for lp, t in top] if top is not None else None
                                          for top in a.get("in_top") or []]
        return {"text": self._text(ids, req.sampling, fr), "output_ids": ids, "meta_info": meta}

    def _text(self, ids: list[int], sp: SamplingParams, fr: dict[str, Any] | None) -> str:
        """Decoded output without the matched stop token / stop string."""
        if self.tokenizer is None:
            return ""
        matched = (fr or {}).get("matched")
        if isinstance(matched, int) and ids and ids[-1] == matched:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=sp.skip_special_tokens)
        if isinstance(matched, str):
            cut = text.find(matched)
            if cut >= 0:
                text = text[:cut]
        return text
