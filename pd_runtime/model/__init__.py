"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3), its HF-directory loader and tokenizer."""
