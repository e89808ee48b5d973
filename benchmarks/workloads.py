"""The models the benchmarks train, each built by a factory ``make(size, device, dtype)``.

A factory returns ``(model, example_inputs, loss_fn)``: ``model(*example_inputs)`` is the
forward, ``loss_fn(output)`` the scalar whose backward is the rest of the training step.
Every model names the modules that ``torch.utils.checkpoint`` should wrap one by one in
``checkpoint_block_types`` (the "checkpoint per block" strategies).

- ``gpt``: a GPT-style decoder stack (pre-LN, causal SDPA, GELU MLP with ff = 4 * width) on
  hidden states that require grad, with loss ``mean(out ** 2)``. It is exactly the model of
  the H100 anchor measurements of torch's strategies (docs/benchmarks.md), so figures compare.
- ``deep``: the same block, deep and narrow (24 x d1024, seq 4096 by default).
- ``resnet``: a ResNet-50-like net of bottleneck blocks with BatchNorm, cross-entropy loss.
- ``unet``: a UNet-like encoder/decoder of conv-BN-ReLU pairs with skip connections,
  per-pixel cross-entropy loss.
- ``hf_gpt2``: Hugging Face transformers' ``GPT2LMHeadModel`` from a config (random
  weights, nothing downloaded, dropout off), next-token cross-entropy on random tokens;
  needs ``transformers``. The strategies that use Hugging Face's own switches
  (``hf_ckpt_offload``) run on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

Factory = Callable[["Size", "torch.device | str", torch.dtype], tuple[nn.Module, tuple, Callable]]


@dataclass(frozen=True)
class Size:
    """Size knobs shared by all workloads; each workload says how it reads them.

    For the transformers ``seq`` is the sequence length; for the conv nets it is the image
    side and ``layers`` the depth (bottleneck blocks per stage, or UNet levels), ``width``
    the base channel count. ``heads`` only matters to the transformers.
    """

    layers: int
    width: int
    heads: int
    seq: int
    batch: int

    def replace(self, **changes) -> "Size":
        return dataclasses.replace(self, **changes)


# Full sizes (the anchor workloads on an H100 for the transformers) and tiny --smoke sizes.
DEFAULT_SIZES = {
    "gpt": Size(layers=8, width=2048, heads=16, seq=2048, batch=8),
    "deep": Size(layers=24, width=1024, heads=16, seq=4096, batch=4),
    "resnet": Size(layers=3, width=64, heads=1, seq=224, batch=64),
    "unet": Size(layers=4, width=64, heads=1, seq=256, batch=16),
    "hf_gpt2": Size(layers=12, width=768, heads=12, seq=1024, batch=8),
}
SMOKE_SIZES = {
    "gpt": Size(layers=2, width=64, heads=4, seq=32, batch=2),
    "deep": Size(layers=3, width=32, heads=2, seq=32, batch=2),
    "resnet": Size(layers=1, width=8, heads=1, seq=32, batch=2),
    "unet": Size(layers=2, width=8, heads=1, seq=32, batch=2),
    "hf_gpt2": Size(layers=2, width=32, heads=2, seq=32, batch=2),
}


# --- transformers ---------------------------------------------------------------------


class DecoderBlock(nn.Module):
    """Pre-LN decoder block: causal self-attention (SDPA) and a GELU MLP."""

    def __init__(self, width: int, heads: int, ff: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not divisible by heads {heads}")
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, ff, bias=False)
        self.fc2 = nn.Linear(ff, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Decoder(nn.Module):
    checkpoint_block_types = (DecoderBlock,)

    def __init__(self, layers: int, width: int, heads: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(DecoderBlock(width, heads, 4 * width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _mean_square(output: torch.Tensor) -> torch.Tensor:
    return output.float().pow(2).mean()


def make_gpt(size: Size, device, dtype: torch.dtype):
    model = Decoder(size.layers, size.width, size.heads).to(device, dtype)
    # Hidden states stand in for an embedding output, so the input's gradient is part of
    # the step as it is in a real model.
    x = torch.randn(size.batch, size.seq, size.width, device=device, dtype=dtype, requires_grad=True)
    return model, (x,), _mean_square


make_deep = make_gpt  # the same block; only the default size differs


# --- ResNet-50-like ---------------------------------------------------------------------


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False), nn.BatchNorm2d(cout)
    )


class Bottleneck(nn.Module):
    """1x1 -> 3x3 -> 1x1 convolutions with BatchNorm and a residual connection."""

    expansion = 4

    def __init__(self, cin: int, mid: int, stride: int) -> None:
        super().__init__()
        cout = mid * self.expansion
        self.reduce = _conv_bn(cin, mid, 1)
        self.spatial = _conv_bn(mid, mid, 3, stride)
        self.expand = _conv_bn(mid, cout, 1)
        self.shortcut = _conv_bn(cin, cout, 1, stride) if stride != 1 or cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.reduce(x))
        out = F.relu(self.spatial(out))
        return F.relu(self.expand(out) + self.shortcut(x))


class ResNet(nn.Module):
    checkpoint_block_types = (Bottleneck,)

    def __init__(self, blocks_per_stage: tuple[int, ...], width: int, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(_conv_bn(3, width, 7, 2), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], width
        for stage, count in enumerate(blocks_per_stage):
            mid = width * 2**stage
            for i in range(count):
                blocks.append(Bottleneck(cin, mid, stride=2 if i == 0 and stage > 0 else 1))
                cin = mid * Bottleneck.expansion
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet_stages(layers: int) -> tuple[int, ...]:
    """Blocks per stage: ``layers=3`` is ResNet-50's (3, 4, 6, 3); other values scale it."""
    return tuple(max(1, round(n * layers / 3)) for n in (3, 4, 6, 3))


def make_resnet(size: Size, device, dtype: torch.dtype):
    model = ResNet(resnet_stages(size.layers), size.width).to(device, dtype)
    images = torch.randn(size.batch, 3, size.seq, size.seq, device=device, dtype=dtype)
    labels = torch.randint(0, 1000, (size.batch,), device=device)

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), labels)

    return model, (images,), loss_fn


# --- UNet-like ---------------------------------------------------------------------------


class DoubleConv(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.first = _conv_bn(cin, cout, 3)
        self.second = _conv_bn(cout, cout, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.second(F.relu(self.first(x))))


class UNet(nn.Module):
    checkpoint_block_types = (DoubleConv,)

    def __init__(self, depth: int, width: int, classes: int = 2) -> None:
        super().__init__()
        channels = [width * 2**level for level in range(depth + 1)]
        self.inc = DoubleConv(3, channels[0])
        self.down = nn.ModuleList(DoubleConv(channels[i], channels[i + 1]) for i in range(depth))
        self.upsample = nn.ModuleList(
            nn.ConvTranspose2d(channels[i + 1], channels[i], 2, stride=2) for i in reversed(range(depth))
        )
        self.up = nn.ModuleList(DoubleConv(2 * channels[i], channels[i]) for i in reversed(range(depth)))
        self.out = nn.Conv2d(channels[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inc(x)
        skips = []
        for block in self.down:
            skips.append(x)
            x = block(F.max_pool2d(x, 2))
        for upsample, block, skip in zip(self.upsample, self.up, reversed(skips)):
            x = block(torch.cat([skip, upsample(x)], dim=1))
        return self.out(x)


def make_unet(size: Size, device, dtype: torch.dtype):
    if size.seq % 2**size.layers:
        raise ValueError(f"unet: image side {size.seq} must be divisible by 2**layers = {2**size.layers}")
    model = UNet(size.layers, size.width).to(device, dtype)
    images = torch.randn(size.batch, 3, size.seq, size.seq, device=device, dtype=dtype)
    labels = torch.randint(0, 2, (size.batch, size.seq, size.seq), device=device)

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), labels)

    return model, (images,), loss_fn


# --- Hugging Face transformers ----------------------------------------------------------------

HF_VOCAB = 512


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM as the benchmarks call models: ``model(tokens)`` -> logits.
    ``hf_model`` is the transformers model itself, for the strategies that use its own
    switches (``gradient_checkpointing_enable``)."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf_model = hf_model
        self.checkpoint_block_types = tuple(type(block) for block in hf_model.transformer.h[:1])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf_model(input_ids=tokens, use_cache=False).logits


def make_hf_gpt2(size: Size, device, dtype: torch.dtype):
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as error:
        raise ImportError("the hf_gpt2 workload needs transformers (pip install transformers)") from error
    config = GPT2Config(vocab_size=HF_VOCAB, n_positions=size.seq, n_embd=size.width, n_layer=size.layers,
                        n_head=size.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    model = HFCausalLM(GPT2LMHeadModel(config)).to(device, dtype).train()
    tokens = torch.randint(0, HF_VOCAB, (size.batch, size.seq + 1), device=device)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    return model, (inputs,), loss_fn


FACTORIES: dict[str, Factory] = {"gpt": make_gpt, "deep": make_deep, "resnet": make_resnet, "unet": make_unet,
                                 "hf_gpt2": make_hf_gpt2}
HF_WORKLOADS = ("hf_gpt2",)


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 on GPU (as trained there), fp32 on CPU (where bf16 kernels are slow or missing)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def build(name: str, size: Size, device, dtype: torch.dtype, seed: int = 0):
    """``FACTORIES[name](size, device, dtype)`` under a fixed seed, so every strategy gets the
    same weights and the same inputs."""
    if name not in FACTORIES:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(FACTORIES)}")
    torch.manual_seed(seed)
    return FACTORIES[name](size, device, dtype)
