"""Vision Transformer (ViT, Dosovitskiy et al. 2020): non-overlapping patches embedded
by a strided Conv2d, a class token, learned positions (starting as a 2-D sin-cos
table), pre-norm blocks (LayerNorm, non-causal multi-head attention through SDPA, GELU
MLP), and a linear head read off the class token.

Defaults are ViT-Tiny/16 at 224 px: 14 x 14 = 196 patches, 12 layers, width 192, 3 heads.

Shapes in comments: B batch, N patches (+1 with the class token), C channels (d_model),
H heads, D head dim, P patch size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from toy.models.family import Family
from toy.models.layers import GeluMLP, run_block


@dataclass
class VitConfig:
    image_size: int = 224
    patch_size: int = 16
    channels: int = 3
    n_layer: int = 12
    d_model: int = 192
    n_head: int = 3
    d_ff: int = 768
    n_classes: int = 1000
    dropout: float = 0.0
    norm_eps: float = 1e-6  # timm's ViT LayerNorm eps
    arch: str = field(default="vit")

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def to_dict(self) -> dict:
        return asdict(self)


def check_vit_config(cfg: VitConfig) -> list[str]:
    """Every shape problem at once, named by the flag that sets it."""
    p = []
    for name, flag in (
        ("image_size", "--image-size"),
        ("patch_size", "--patch-size"),
        ("n_layer", "--n-layer"),
        ("d_model", "--d-model"),
        ("n_head", "--n-head"),
        ("n_classes", "the image folder's classes"),
    ):
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            p.append(f"{flag} must be an integer >= 1, got {v!r}")
    if p:
        return p
    if cfg.image_size % cfg.patch_size:
        p.append(
            f"--image-size {cfg.image_size} must be a multiple of --patch-size {cfg.patch_size}"
        )
    if cfg.d_model % cfg.n_head:
        p.append(f"--d-model {cfg.d_model} must be divisible by --n-head {cfg.n_head}")
    return p


def sincos_2d(grid: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """(grid * grid, dim) position codes of a grid x grid patch layout, row-major: a
    quarter of the channels are sin(row * w), cos(row * w), sin(col * w), cos(col * w)
    over geometric frequencies w. Channels beyond a multiple of 4 are cut off."""
    q = -(-dim // 4)  # frequencies per (axis, sin|cos): ceil(dim / 4)
    omega = base ** -(torch.arange(q, dtype=torch.float64) / q)  # (q,)
    ys, xs = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")
    y = ys.flatten()[:, None] * omega  # (grid^2, q)
    x = xs.flatten()[:, None] * omega
    return torch.cat([y.sin(), y.cos(), x.sin(), x.cos()], dim=1)[:, :dim].float()


class SelfAttention(nn.Module):
    """Every token sees every token (no causal mask): an image has no order."""

    def __init__(self, cfg: VitConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).view(B, N, 3, self.n_head, C // self.n_head)  # (B, N, 3, H, D)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, H, N, D)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(B, N, C)  # (B, N, C)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, cfg: VitConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = SelfAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = GeluMLP(cfg.d_model, cfg.d_ff)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x)))
        x = x + self.drop(self.mlp(self.norm2(x)))
        return x


class ViT(nn.Module):
    def __init__(self, cfg: VitConfig):
        super().__init__()
        if cfg.image_size % cfg.patch_size:
            raise ValueError(
                f"image_size {cfg.image_size} is not a multiple of patch_size {cfg.patch_size}"
            )
        self.cfg = cfg
        # A Conv2d with kernel = stride = P is exactly "cut into P x P patches, flatten,
        # apply one Linear", in one fused op.
        self.patch_embed = nn.Conv2d(
            cfg.channels, cfg.d_model, kernel_size=cfg.patch_size, stride=cfg.patch_size
        )
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.d_model))
        self.pos_embed = nn.Parameter(torch.zeros(1, cfg.n_patches + 1, cfg.d_model))
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.n_classes)
        self.checkpointing = False  # activation checkpointing per block (--checkpointing)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Linear layers inside the blocks: truncated normal, fan-in scaled (lecun normal,
        # as the patch embedding below), not timm's 0.02. At 0.02 (width 192: a quarter of
        # 1/sqrt(192)) q and k are each a few times smaller than their input, so the logits
        # q.k start near zero: attention is flat (every token the average of all), and
        # each map's gradient is scaled by the other, so the first tens of steps barely move.
        # Measured on 12,000 Fashion-MNIST images, 4 x 128, 200 steps: 70.7% test accuracy
        # with 0.02, 76.1% fan-in scaled (docs/results.md). The head keeps 0.02 (a zero head
        # would leave every other parameter without a gradient on step 1); zero biases;
        # LayerNorm at identity.
        in_blocks = {id(m) for m in self.blocks.modules()}
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(
                    m.weight, std=m.in_features**-0.5 if id(m) in in_blocks else 0.02
                )
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        # The patch embedding is a Linear in disguise: init it like one, fan-in scaled
        # (lecun normal), as the conv's fan-in is channels * P * P.
        fan_in = self.cfg.channels * self.cfg.patch_size**2
        nn.init.trunc_normal_(self.patch_embed.weight, std=fan_in**-0.5)
        nn.init.zeros_(self.patch_embed.bias)
        # Positions start as a 2-D sin-cos table (MAE; Beyer et al. 2022, "Better plain ViT
        # baselines"), still trained. timm's N(0, 0.02) positions are 50x smaller than a
        # patch's embedding (RMS ~1), so at first every background patch looks the same
        # wherever it is and the model spends its first epoch finding out where things are:
        # measured on 12,000 Fashion-MNIST images, 4 x 128, 200 steps: 62% test accuracy
        # from N(0, 0.02), 71% from sin-cos (docs/results.md).
        g = self.cfg.image_size // self.cfg.patch_size
        with torch.no_grad():
            self.pos_embed.zero_()  # the class token's position: none
            self.pos_embed[0, 1:] = sincos_2d(g, self.cfg.d_model)
        nn.init.trunc_normal_(self.cls_token, std=0.02)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """Normalised class-token features (B, C) for float images (B, channels, S, S)."""
        B = images.shape[0]
        x = self.patch_embed(images)  # (B, C, S/P, S/P)
        x = x.flatten(2).transpose(1, 2)  # (B, N, C), patches in row-major order
        cls = self.cls_token.expand(B, -1, -1)  # (B, 1, C)
        x = torch.cat([cls, x], dim=1) + self.pos_embed  # (B, N+1, C)
        x = self.drop(x)
        for block in self.blocks:
            x = run_block(block, x, checkpointing=self.checkpointing)
        return self.norm(x[:, 0])  # (B, C): the class token summarises the image

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))  # (B, n_classes)

    def tie_weights(self) -> None:
        """Nothing is tied in a ViT (the loop re-ties every model after FSDP)."""

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


# Presets give the shape only; n_classes comes from the image folder (the vit-tiny recipe).
FAMILY = Family(
    "vit",
    VitConfig,
    ViT,
    language_model=False,
    presets={
        # ViT-Tiny/16 at 224 px: 196 patches, 12 layers, width 192, 3 heads.
        "vit-tiny": dict(
            image_size=224, patch_size=16, n_layer=12, d_model=192, n_head=3, d_ff=768
        ),
        # ViT-Tiny at half its depth: what the vit-tiny recipe picks for a small image set,
        # where 6 layers learn faster per step than 12 (docs/results.md, Fashion-MNIST ViT).
        "vit-tiny-6": dict(
            image_size=224, patch_size=16, n_layer=6, d_model=192, n_head=3, d_ff=768
        ),
        # 28 px, 7 px patches (16 of them), 2 layers: for tests.
        "tiny": dict(image_size=28, patch_size=7, n_layer=2, d_model=64, n_head=4, d_ff=256),
    },
    default_preset="vit-tiny",
    tiny=dict(image_size=28, patch_size=7, n_layer=2, d_model=64, n_head=4, d_ff=256, n_classes=3),
)
