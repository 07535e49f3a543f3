"""Inference: the KV cache, sampling, the jitted prefill and one-token step, `generate` and the
decode benchmark (`generation`)."""
