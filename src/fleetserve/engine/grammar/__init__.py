"""Constrained decoding: JSON schema, regex and EBNF grammars over the sampler's logits.

* :mod:`.spec` -- which grammar a request asks for (``SamplingParams.json_schema`` /
  ``regex`` / ``ebnf``, SGLang's names) and its check before the request is queued;
* :mod:`.bitmask` -- the packed allowed-token bitmask applied to a batch's logits;
* :mod:`.backend` -- the grammar library (llguidance; see docs/structured_outputs.md
  for why) behind a small interface: tokenizer view, compile, matcher;
* :mod:`.manager` -- compiles off the scheduler step in a worker thread, caches
  compiled grammars by (kind, text), and hands requests back when theirs is ready.
"""
