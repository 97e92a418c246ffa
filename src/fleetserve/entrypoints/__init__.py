"""The front door of ``fleetserve serve``: the HTTP app (OpenAI and SGLang-native
routes), the tokenizer manager and detokenizer, the offline ``Engine``, and the
server's start-up."""
