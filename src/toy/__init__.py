"""toy: a small, readable trainer for decoder language models, LoRA fine-tunes of
GGUF bases and a ViT-Tiny classifier. See docs/architecture.md for the layers."""

__version__ = "0.1.0"
