"""The one training loop, shared by every recipe (see loop.py)."""
