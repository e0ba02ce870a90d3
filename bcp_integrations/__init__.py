"""Thin integrations of bcp with training frameworks (Lightning, Accelerate, HF Transformers, Megatron-core)."""
