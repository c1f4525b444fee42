"""Models: loading Hugging Face causal LMs and tokenizers, and the embedded tiny model."""
