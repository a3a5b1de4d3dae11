"""Data: token files and windows, chat JSONL, packing, image folders. Never imports toy.models."""
