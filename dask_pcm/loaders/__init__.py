"""Loaders: what builds a context from its template (a causal language model and its
tokenizer) and the embedded default model."""
