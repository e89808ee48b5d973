"""Model families beyond the budget contract's five: the shapes of code the planner and the
scheduled peak meet less often. Tiny, random init, CPU; each is ``(model, inputs, loss)``.

- ``causal_attention_bf16``: attention written out in bf16 (a causal ``masked_fill``,
  ``softmax``, two ``bmm``), which Inductor's C++ backend runs as a few multi-kernel calls;
- ``conv1d_bn``: Conv1d, BatchNorm1d, a grouped Conv1d and average pooling, whose backward
  receives a saved tensor for its shape alone and runs mkldnn's ``convolution_backward``;
- ``unet``: a two-level U-Net (GroupNorm, strided and transposed convolutions, a skip
  concatenation);
- ``moe``: top-2 routing over four experts (``topk``, gathered expert weights, ``bmm``,
  ``index_add``);
- ``custom_function``: a ``torch.autograd.Function`` with ``save_for_backward`` and
  in-place ops on fresh tensors;
- ``tied_lm``: token embedding tied to the output projection, two pre-norm
  ``TransformerEncoderLayer`` blocks, cross-entropy;
- ``inplace_residual``: a residual MLP with in-place ``relu_`` and an in-place scale of the
  stream, whose backward's pointwise gradients Inductor inlines into later kernels;
- ``lora``: LayerNorm and ``nn.Linear`` frozen (``requires_grad=False``), low-rank adapters
  trained.

    python -m compile_offload.benchmarks.budget_contract --models extra
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CausalAttention(nn.Module):
    """Pre-norm blocks of attention written out: ``masked_fill`` with a causal mask,
    ``softmax``, two ``bmm``."""

    def __init__(self, d: int = 64, heads: int = 4, blocks: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(blocks))
        self.out = nn.ModuleList(nn.Linear(d, d) for _ in range(blocks))
        self.norm = nn.ModuleList(nn.LayerNorm(d) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d = x.shape
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=x.device), 1)
        for qkv, out, norm in zip(self.qkv, self.out, self.norm):
            q, k, v = qkv(norm(x)).view(batch, seq, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            scores = (q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5
            attended = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
            x = x + out(attended.transpose(1, 2).reshape(batch, seq, d))
        return x


class Conv1dNet(nn.Module):
    """Conv1d, BatchNorm1d, a grouped Conv1d, average pooling, a linear head."""

    def __init__(self, channels: int = 32, length: int = 128) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv1d(8, channels, 5, padding=2), nn.BatchNorm1d(channels), nn.SiLU(),
                                 nn.Conv1d(channels, channels, 5, padding=2, groups=4), nn.BatchNorm1d(channels),
                                 nn.SiLU(), nn.AvgPool1d(2), nn.Conv1d(channels, channels, 3, padding=1), nn.SiLU())
        self.head = nn.Linear(channels * length // 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x).flatten(1))


class UNet(nn.Module):
    """Two levels: GroupNorm, a strided and a transposed convolution, a skip concatenation."""

    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        c = channels
        self.down1 = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.GroupNorm(4, c), nn.SiLU())
        self.down2 = nn.Sequential(nn.Conv2d(c, 2 * c, 3, padding=1, stride=2), nn.GroupNorm(4, 2 * c), nn.SiLU())
        self.middle = nn.Sequential(nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.SiLU())
        self.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.head = nn.Conv2d(2 * c, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.down1(x)
        low = self.down2(skip)
        low = low + self.middle(low)
        return self.head(torch.cat([skip, self.up(low)], 1))


class MoE(nn.Module):
    """Top-k routing: each token's experts' weights gathered, two ``bmm``, ``index_add``."""

    def __init__(self, d: int = 64, experts: int = 4, k: int = 2) -> None:
        super().__init__()
        self.gate, self.k = nn.Linear(d, experts), k
        self.w1 = nn.Parameter(torch.randn(experts, d, 2 * d) * 0.05)
        self.w2 = nn.Parameter(torch.randn(experts, 2 * d, d) * 0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.gate(x).softmax(-1).topk(self.k, -1)
        out = torch.zeros_like(x)
        rows = torch.arange(x.shape[0], device=x.device)
        for j in range(self.k):
            hidden = F.gelu(torch.bmm(x.unsqueeze(1), self.w1[chosen[:, j]]))
            out = out.index_add(0, rows, torch.bmm(hidden, self.w2[chosen[:, j]]).squeeze(1) * weights[:, j:j + 1])
        return out + x


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class CustomFunctionNet(nn.Module):
    """Linear layers through a custom autograd function, with in-place ops on fresh tensors."""

    def __init__(self, width: int = 128, layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            y = F.relu(layer(x)) * 2
            y.add_(1.0)
            x = _Square.apply(y) * 0.1 + x
        return x


class TiedLM(nn.Module):
    """Token embedding tied to the output projection, pre-norm encoder blocks."""

    def __init__(self, vocab: int = 256, d: int = 64, blocks: int = 2, seq: int = 64) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, d)
        self.position = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True,
                                                               norm_first=True) for _ in range(blocks))
        self.norm = nn.LayerNorm(d)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embedding.weight.t()


class InplaceResidual(nn.Module):
    """Residual linear layers with ``relu_`` on each layer's output and the stream scaled in place."""

    def __init__(self, width: int = 128, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            y = layer(x)
            y.relu_()
            x = x + y
            x.mul_(0.9)
        return x


class _LoRALinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, rank: int = 8) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out).requires_grad_(False)
        self.a = nn.Parameter(torch.randn(d_in, rank) * 0.02)
        self.b = nn.Parameter(torch.full((rank, d_out), 0.01))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a) @ self.b


class LoRAMLP(nn.Module):
    """Pre-norm residual MLP blocks, the base weights and norms frozen, adapters trained."""

    def __init__(self, width: int = 128, layers: int = 4) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(width).requires_grad_(False) for _ in range(layers))
        self.up = nn.ModuleList(_LoRALinear(width, 4 * width) for _ in range(layers))
        self.down = nn.ModuleList(_LoRALinear(4 * width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, up, down in zip(self.norms, self.up, self.down):
            x = x + down(F.gelu(up(norm(x))))
        return x


def _square_mean(output: torch.Tensor) -> torch.Tensor:
    return output.float().pow(2).mean()


def _next_token_loss(logits: torch.Tensor) -> torch.Tensor:
    targets = torch.arange(logits.shape[0] * logits.shape[1], device=logits.device) % logits.shape[-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets)


FAMILIES = ("causal_attention_bf16", "conv1d_bn", "unet", "moe", "custom_function", "tied_lm", "inplace_residual",
            "lora")


def build(name: str):
    """``(model, inputs, loss_of_output)`` for one of ``FAMILIES``; seeded."""
    torch.manual_seed(0)
    if name == "causal_attention_bf16":
        return CausalAttention().to(torch.bfloat16), (torch.randn(4, 64, 64, dtype=torch.bfloat16),), _square_mean
    if name == "conv1d_bn":
        return Conv1dNet(), (torch.randn(8, 8, 128),), _square_mean
    if name == "unet":
        return UNet(), (torch.randn(4, 3, 32, 32),), _square_mean
    if name == "moe":
        return MoE(), (torch.randn(128, 64),), _square_mean
    if name == "custom_function":
        return CustomFunctionNet(), (torch.randn(64, 128, requires_grad=True),), _square_mean
    if name == "tied_lm":
        return TiedLM(), (torch.randint(0, 256, (4, 64)),), _next_token_loss
    if name == "inplace_residual":
        return InplaceResidual(), (torch.randn(512, 128),), _square_mean
    if name == "lora":
        return LoRAMLP(), (torch.randn(256, 128),), _square_mean
    raise ValueError(f"unknown family {name!r}; known: {', '.join(FAMILIES)}")
