"""One inference instance: scheduler, KV cache, radix cache, HTTP API."""
