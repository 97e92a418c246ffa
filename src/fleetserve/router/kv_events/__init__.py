"""Precise routing on the engines' own KV-cache events (``--policy kv_aware``).

* :mod:`.decode`: vLLM's / SGLang's ZMQ frames -> :class:`~.decode.EventBatch`.
* :mod:`.index`: chained block keys of token ids -> the (worker, DP rank) targets holding them.
* :mod:`.subscriber`: one ZMQ SUB thread per (worker, DP rank), gap detection and replay.
* :mod:`.tokenize`: the router-side tokenizer and chat template (``--tokenizer-path``).
* :mod:`.policy`: the cost model and the trust state machine (``KvAwarePolicy``).
"""
