"""Bytes on disk <-> tensors: GGUF, PEFT adapters, checkpoints. Strict: names, shapes, dtypes
checked."""
