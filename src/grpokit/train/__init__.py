"""Training: the GRPO loop (``trainer``), batching and gradients (``batch``), logs (``metrics``)."""
