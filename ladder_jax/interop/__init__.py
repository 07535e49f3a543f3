"""Interoperability: Hugging Face Llama checkpoints in and out (`hf`), GGUF files in (`gguf`)
and tokenizers (`tokenizer`)."""
