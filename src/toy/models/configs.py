"""The configs of the model families read from GGUF files (llama and its variants, Phi-3,
Gemma), torch-free: `toy describe` and the GGUF readers size a model from a header
without importing torch. Each model file re-exports its own."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass
class LlamaConfig:
    vocab_size: int = 4096
    n_layer: int = 4
    d_model: int = 256
    n_head: int = 8
    n_kv_head: int = 4
    d_ff: int = 0  # 0: SwiGLU's usual 8/3 * d_model, rounded up to a multiple of 64
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    qkv_bias: bool = False  # qwen2 has q/k/v biases
    head_dim: int = 0  # 0: d_model // n_head
    qk_norm: bool = False  # qwen3: RMSNorm on each head's queries and keys
    sliding_window: int = 0  # mistral-style files that declare one: each token sees this many (0: all)
    arch: str = field(default="llama")

    def __post_init__(self) -> None:
        if self.d_ff == 0:
            self.d_ff = 64 * math.ceil(8 * self.d_model / 3 / 64)
        if self.head_dim == 0:
            self.head_dim = self.d_model // self.n_head

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Phi3Config:
    vocab_size: int = 4096
    n_layer: int = 4
    d_model: int = 256
    n_head: int = 8
    n_kv_head: int = 8
    head_dim: int = 32
    rope_dim: int = 32  # dims of each head that rotate (partial rotary when < head_dim)
    d_ff: int = 1024
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    sliding_window: int = 0
    tie_embeddings: bool = False
    arch: str = field(default="phi3")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class GemmaConfig:
    vocab_size: int = 4096
    n_layer: int = 6
    d_model: int = 256
    n_head: int = 4
    n_kv_head: int = 1
    head_dim: int = 64
    d_ff: int = 1024
    max_seq_len: int = 2048
    rope_theta: float = 1_000_000.0  # global layers
    rope_local_theta: float = 10_000.0  # local (sliding-window) layers
    sliding_window: int = 512
    global_every: int = 6  # layer i is global when i % global_every == global_every - 1
    norm_eps: float = 1e-6
    qk_norm: bool = True  # Gemma 3
    attn_softcap: float = 0.0  # Gemma 2: 50
    final_softcap: float = 0.0  # Gemma 2: 30
    tie_embeddings: bool = True
    # Queries are scaled by 1/sqrt(query_pre_attn_scalar): the head size, except in the 27B
    # models (d_model / n_head: 144 for Gemma 2, 168 for Gemma 3, where heads are 128 wide).
    query_pre_attn_scalar: int = 0  # 0: head_dim
    arch: str = field(default="gemma")

    def __post_init__(self) -> None:
        if self.query_pre_attn_scalar == 0:
            self.query_pre_attn_scalar = self.head_dim

    def is_global(self, layer: int) -> bool:
        return layer % self.global_every == self.global_every - 1

    def to_dict(self) -> dict:
        return asdict(self)
