"""Interoperability: Hugging Face Llama checkpoints in and out (`hf`) and tokenizers
(`tokenizer`)."""
