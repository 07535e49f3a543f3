"""Inference: the KV cache (`cache`), sampling (`sampling`), the jitted prefill and one-token
step, `generate` and the decode benchmark (`generation`), continuous batching (`batching`) and
the OpenAI-compatible HTTP server on top of it (`server`, needs the `serve` extra)."""
