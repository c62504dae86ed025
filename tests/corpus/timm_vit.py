"""Corpus: a Vision Transformer, written out as timm's `vision_transformer.py` writes it (random weights).

Imitates: timm's VisionTransformer (ViT-B/16 and family). Constructs: a Conv2d patch embedding whose
output is flattened and transposed to (B, N, C); a learned class token concatenated in front and a
learned position embedding added; pre-norm blocks with ONE fused `qkv` nn.Linear whose output is
`.reshape(B, N, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4)` and `.unbind(0)` into q/k/v (the
(..., 3, H, hd) layout, not GPT-2's `.split`), `F.scaled_dot_product_attention` without a mask,
`proj`; an Mlp of `fc1` / GELU / `fc2`; a final LayerNorm and a classification `head` on the class
token. 2 blocks, 32 x 32 images in 8 x 8 patches (16 patches + the class token), hidden 64, 4 heads,
MLP 256, 10 classes, dropout 0.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

IMG, PATCH, CHANNELS, DIM, DEPTH, HEADS, MLP_RATIO, CLASSES = 32, 8, 3, 64, 2, 4, 4, 10


class PatchEmbed(nn.Module):
    """Image to patch tokens: a strided convolution, then (B, C, H', W') -> (B, H' W', C)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Conv2d(CHANNELS, DIM, kernel_size=PATCH, stride=PATCH)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, dim, num_heads, qkv_bias=True):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v)
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class Mlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, dim * mlp_ratio)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch_embed = PatchEmbed()
        num_patches = (IMG // PATCH) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, DIM))
        self.pos_embed = nn.Parameter(torch.randn(1, num_patches + 1, DIM) * 0.02)
        self.blocks = nn.Sequential(*[Block(DIM, HEADS, MLP_RATIO) for _ in range(DEPTH)])
        self.norm = nn.LayerNorm(DIM, eps=1e-6)
        self.head = nn.Linear(DIM, CLASSES)
        nn.init.normal_(self.cls_token, std=1e-6)

    def forward(self, x):
        x = self.patch_embed(x)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        x = x + self.pos_embed
        x = self.blocks(x)
        x = self.norm(x)
        return self.head(x[:, 0])


def build_model():
    torch.manual_seed(0)
    return VisionTransformer()


def example_inputs(batch_size: int = 2):
    return (torch.randn(batch_size, CHANNELS, IMG, IMG),)
