"""Inference: the KV cache, sampling, `generate` and the decode benchmark (`generation`),
continuous batching (`batching`) and the OpenAI-compatible server on top (`server`)."""
