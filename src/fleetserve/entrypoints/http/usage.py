"""OpenAI ``usage`` blocks from the token counts of finished outputs."""

from __future__ import annotations

from typing import Sequence

from fleetserve.entrypoints.openai_protocol import PromptTokensDetails, UsageInfo
from fleetserve.entrypoints.tokenizer_manager import TokenOutput


def usage_of(prompt_counts: Sequence[int], cached_counts: Sequence[int], completion: int) -> UsageInfo:
    """Usage of prompts counted once each (``prompt_counts``, ``cached_counts``: one entry
    per prompt) and ``completion`` tokens generated over all choices."""
    prompt = sum(prompt_counts)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cached_counts)),
    )


def stream_usage(last: dict[int, TokenOutput], n: int) -> UsageInfo:
    """Usage for a stream's final chunk from each choice's last output (choice ``i`` is
    sample ``i % n`` of prompt ``i // n``): prompts and cached tokens counted once per
    prompt, completion tokens summed over every choice."""
    completion = sum(o.completion_tokens for o in last.values())
    firsts = [last[i] for i in sorted(last) if i % n == 0]
    return usage_of([o.prompt_tokens for o in firsts], [o.cached_tokens for o in firsts], completion)


def continuous_usage(stream_options) -> bool:
    """vLLM's ``stream_options.continuous_usage_stats``: every chunk carries the usage so far.

    As in vLLM it takes effect with ``include_usage`` (which adds the final usage-only chunk).
    """
    return bool(stream_options and stream_options.include_usage and stream_options.continuous_usage_stats)


def usage_so_far(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    """The usage of one choice's chunk under continuous usage stats (vLLM: per choice, its
    prompt and the tokens it has generated so far)."""
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)
