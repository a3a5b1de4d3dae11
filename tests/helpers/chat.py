"""SMOLLM2's chat template (the real model's), for the tests that render it."""

from __future__ import annotations

# SmolLM2-Instruct's template (ChatML plus a default system prompt); the backslash at the end of
# the first line only wraps it (Python drops it and the newline).
SMOLLM2 = """{% for message in messages %}\
{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system
You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
' }}{% endif %}{{'<|im_start|>' + message['role'] + '
' + message['content'] + '<|im_end|>' + '
'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant
' }}{% endif %}"""
