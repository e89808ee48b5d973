"""Small models for backend tests, and a training-parity harness.

Every model is tiny (a few thousand parameters at most) so a compile with
``inner_compiler="eager"`` takes well under a second; each still contains the feature
it is named after, because the parity tests are only worth something if the partitioner
has that feature to get wrong.

``check_training_parity`` trains two copies of one model, one eagerly and one through
``torch.compile``, and asserts they agree step by step.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._pytree import tree_leaves

# Tight fp32 tolerances: both sides run the same float32 math up to operation order
# (decompositions, fused kernels), which moves results by a few ulps, and three optimizer
# steps only compound that a little.
FP32_RTOL = 1e-5
FP32_ATOL = 1e-6
# Under bf16 autocast the compiled graphs legitimately round differently from eager
# (decomposed SDPA and GELU run as several bf16 ops where eager runs one fused kernel), by
# a few bf16 ulps: more than any fixed tolerance tight enough to catch a wrong gradient.
# So the compiled run is compared with an fp32 run instead: its RMSE from the fp32
# result may be at most this multiple of eager bf16's, the multiplier torch's own
# accuracy checker (torch._dynamo.utils.same) uses for bf16.
BF16_ERROR_MULTIPLIER = 3.0


# --------------------------------------------------------------------------- models


class MLP(nn.Module):
    """Linear -> GELU -> Linear -> Tanh -> Linear."""

    def __init__(self, d_in: int = 16, d_hidden: int = 32, d_out: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.fc3 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(F.gelu(self.fc1(x)))))


class TransformerBlock(nn.Module):
    """Pre-norm block: LayerNorm -> causal SDPA (with attention dropout) -> dropout ->
    residual, LayerNorm -> Linear -> GELU -> Linear -> dropout -> residual."""

    def __init__(self, d_model: int = 16, n_heads: int = 2, d_ff: int = 32, dropout: float = 0.1) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.ff1 = nn.Linear(d_model, d_ff)
        self.ff2 = nn.Linear(d_ff, d_model)
        self.drop = nn.Dropout(dropout)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.n_heads, d_model // self.n_heads).permute(2, 0, 3, 1, 4)
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attention(self.ln1(x)))
        return x + self.drop(self.ff2(F.gelu(self.ff1(self.ln2(x)))))


class ConvBN(nn.Module):
    """Conv -> BatchNorm -> ReLU, twice, then pooling and a Linear head. Used in train
    mode, so every forward updates the BatchNorm running statistics (buffer mutation)."""

    def __init__(self, channels: int = 3, width: int = 4, classes: int = 5) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, width, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


class InPlaceWithBuffers(nn.Module):
    """In-place ops on activations (``add_``, ``relu_``, ``mul_``) and two buffers
    updated in forward: a step counter and a running sum of an activation."""

    def __init__(self, d_in: int = 16, d_hidden: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_in)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("running_sum", torch.zeros(d_hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h.add_(0.5)  # before relu_: relu's backward needs its output unmodified
        h.relu_()
        self.steps.add_(1)
        self.running_sum.add_(h.detach().sum(dim=0))
        out = self.fc2(h)
        out.mul_(2.0)
        return out


class ReadsMutatedBuffer(nn.Module):
    """The backward needs a value computed from a buffer that the same forward mutates.

    A partition that recomputes that value in the backward (cheap: a cast and a
    reciprocal) instead of saving it reads the buffer after the forward's write-back and
    gets the wrong value, so the gradients differ from eager while the outputs match.
    """

    def __init__(self, d_in: int = 16, d_out: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps.add_(1)
        return self.fc(x) * self.steps.float().reciprocal()


class SnapshotThenUpdate(nn.Module):
    """A buffer snapshotted with ``clone()``, then updated in place (an EMA of the inputs),
    the snapshot read by the backward directly and through a transposed view. Inductor's
    joint-graph passes drop the clone as a no-op, so the joint graph's backward reads the
    buffer itself, which the forward has written by then (review34c F6: wrong gradients
    under torch.compile too)."""

    def __init__(self, d_in: int = 16, d_out: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_in)
        self.out = nn.Linear(d_in, d_out)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d_in))
        self.register_buffer("mix", torch.eye(d_in) + 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale, mix = self.scale.clone(), self.mix.clone()
        self.scale.mul_(0.9).add_(x.detach().abs().mean(0), alpha=0.1)
        self.mix.mul_(0.5)
        h = torch.tanh(self.fc(x) * scale)
        return self.out(h @ mix.t())


class EmbeddingMaxNorm(nn.Module):
    """``nn.Embedding(max_norm=...)`` renormalises its weight's rows in place in the forward.
    The weight requires grad, so AOTAutograd writes the new rows back after the graph runs
    (a forward output), not inside it: a plan that recomputes the lookup in the backward from
    the weight reads the written-back rows (autograd's version check raised)."""

    def __init__(self, vocab: int = 64, d: int = 32) -> None:
        super().__init__()
        self.emb, self.fc = nn.Embedding(vocab, d, max_norm=1.0), nn.Linear(d, 48)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        return torch.tanh(self.fc(h)) * h.sum(-1, keepdim=True)


class GraphBreakMLP(nn.Module):
    """An MLP with ``torch._dynamo.graph_break()`` between its layers: two compiled graphs,
    the backward of the first receiving its gradient from the second."""

    def __init__(self, d_in: int = 16, d_hidden: int = 32, d_out: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x))
        torch._dynamo.graph_break()
        return self.fc2(torch.tanh(h))


class ResidualLM(nn.Module):
    """Embedding -> Linear -> two residual blocks (Linear -> GELU -> Linear -> LayerNorm) ->
    tanh -> Linear -> a vocabulary head, returning the cross-entropy of predicting its own
    tokens. Linears on a sequence save an ``addmm`` and views of it: the model of issue 49,
    whose plan once saved both and got wrong gradients from Inductor's in-place backward."""

    class Block(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.f = nn.Sequential(nn.Linear(d, 128), nn.GELU(), nn.Linear(128, d), nn.LayerNorm(d))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.f(x)

    def __init__(self, vocab: int = 64, d: int = 32) -> None:
        super().__init__()
        self.emb, self.pre = nn.Embedding(vocab, d), nn.Linear(d, d)
        self.blocks = nn.Sequential(self.Block(d), self.Block(d))
        self.post, self.head = nn.Linear(d, d), nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.blocks(self.pre(self.emb(tokens))))
        return F.cross_entropy(self.head(self.post(h)).flatten(0, 1), tokens.flatten())


# Input builders matching the default sizes above.


def mlp_inputs() -> tuple[torch.Tensor]:
    return (torch.randn(4, 16),)


def sequence_inputs() -> tuple[torch.Tensor]:
    return (torch.randn(2, 6, 16),)


def token_inputs() -> tuple[torch.Tensor]:
    return (torch.randint(0, 64, (8, 16)),)


def image_inputs() -> tuple[torch.Tensor]:
    return (torch.randn(4, 3, 6, 6),)


# --------------------------------------------------------------------------- harness


@dataclass
class StepRecord:
    """What one optimizer step produced on one side (detached clones)."""

    outputs: list[list[torch.Tensor]]  # per micro-batch, the output's tensor leaves
    losses: list[torch.Tensor]  # per micro-batch
    grads: dict[str, torch.Tensor | None]  # accumulated, before the optimizer step
    params: dict[str, torch.Tensor]  # after the optimizer step
    buffers: dict[str, torch.Tensor]  # after the optimizer step

    def named_tensors(self) -> dict[str, torch.Tensor | None]:
        """Every recorded tensor under a name that says what it is."""
        named: dict[str, torch.Tensor | None] = {}
        for micro, leaves in enumerate(self.outputs):
            named.update({f"micro-batch {micro} output {i}": t for i, t in enumerate(leaves)})
        named.update({f"micro-batch {micro} loss": t for micro, t in enumerate(self.losses)})
        named.update({f"grad of {n}": t for n, t in self.grads.items()})
        named.update({f"parameter {n}": t for n, t in self.params.items()})
        named.update({f"buffer {n}": t for n, t in self.buffers.items()})
        return named


@dataclass
class ParityResult:
    eager: list[StepRecord]
    compiled: list[StepRecord]
    graphs_compiled: int  # graphs the backend compiled (more than one with graph breaks)
    warnings: list[warnings.WarningMessage] = field(default_factory=list)  # raised while compiling/running

    def warning_messages(self) -> list[str]:
        return [str(w.message) for w in self.warnings]


def default_loss(output: Any) -> torch.Tensor:
    """Mean of squares over every tensor in the output, in fp32: every output element
    gets a distinct, nonzero gradient."""
    return sum((leaf.float() ** 2).mean() for leaf in tree_leaves(output) if isinstance(leaf, torch.Tensor))


def default_optimizer(params) -> torch.optim.Optimizer:
    # Momentum makes each step depend on every earlier gradient, so an error in any
    # step's backward shows up in every later parameter comparison.
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _train(
    model: nn.Module,
    forward: Callable[..., Any],
    inputs: Sequence[Sequence[tuple]],
    *,
    seed: int,
    autocast_dtype: torch.dtype | None,
    make_optimizer: Callable[..., torch.optim.Optimizer],
    loss_fn: Callable[[Any], torch.Tensor],
) -> list[StepRecord]:
    """Train ``model`` on ``inputs[step][micro_batch]``, calling it through ``forward``
    (the model itself, or its compiled wrapper, whose parameter names carry a prefix).

    The global RNG is re-seeded before each micro-batch's forward, so dropout draws the
    same masks on both sides provided both consume the RNG the same way.
    """
    optimizer = make_optimizer(model.parameters())
    grad_accum = len(inputs[0])
    records = []
    for step, micro_batches in enumerate(inputs):
        optimizer.zero_grad(set_to_none=True)
        outputs, losses = [], []
        for micro, args in enumerate(micro_batches):
            torch.manual_seed(seed + 1000 * step + micro)
            with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
                output = forward(*[a.clone() for a in args])
            loss = loss_fn(output) / grad_accum
            loss.backward()
            outputs.append([t.detach().clone() for t in tree_leaves(output) if isinstance(t, torch.Tensor)])
            losses.append(loss.detach().clone())
        grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
        optimizer.step()
        records.append(StepRecord(
            outputs=outputs,
            losses=losses,
            grads=grads,
            params={n: p.detach().clone() for n, p in model.named_parameters()},
            buffers={n: b.detach().clone() for n, b in model.named_buffers()},
        ))
    return records


def _rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).pow(2).mean().sqrt().item()


def _assert_as_accurate(what: str, compiled: torch.Tensor, eager: torch.Tensor, reference: torch.Tensor) -> None:
    """``compiled`` is no further from the fp32 ``reference`` than ``eager`` is, up to
    ``BF16_ERROR_MULTIPLIER`` (plus FP32_ATOL for tensors eager gets exactly)."""
    assert compiled.shape == eager.shape and compiled.dtype == eager.dtype, (
        f"{what}: {compiled.dtype}{list(compiled.shape)} vs eager {eager.dtype}{list(eager.shape)}")
    compiled_error, eager_error = _rmse(compiled, reference), _rmse(eager, reference)
    assert compiled_error <= BF16_ERROR_MULTIPLIER * eager_error + FP32_ATOL, (
        f"{what}: RMSE from the fp32 run is {compiled_error:.3g} compiled vs {eager_error:.3g} eager "
        f"(allowed: {BF16_ERROR_MULTIPLIER}x eager + {FP32_ATOL})")


def _assert_step_matches(
    step: int,
    compiled: StepRecord,
    eager: StepRecord,
    reference: StepRecord | None,
    rtol: float,
    atol: float,
) -> None:
    """Compare every tensor of one step: tightly, or against the fp32 ``reference`` run
    when one is given (autocast)."""
    c_named, e_named = compiled.named_tensors(), eager.named_tensors()
    assert c_named.keys() == e_named.keys(), f"step {step}: {sorted(c_named.keys() ^ e_named.keys())}"
    r_named = reference.named_tensors() if reference is not None else {}
    for what, e_tensor in e_named.items():
        c_tensor, label = c_named[what], f"step {step} {what}"
        assert (c_tensor is None) == (e_tensor is None), f"{label}: compiled {c_tensor} vs eager {e_tensor}"
        if e_tensor is None:
            continue
        if reference is None or not e_tensor.is_floating_point():
            torch.testing.assert_close(c_tensor, e_tensor, rtol=rtol, atol=atol, msg=lambda m: f"{label}: {m}")
        else:
            _assert_as_accurate(label, c_tensor, e_tensor, r_named[what])


def check_training_parity(
    make_model: Callable[[], nn.Module],
    make_inputs: Callable[[], tuple],
    backend: Callable[..., Any] | str,
    *,
    steps: int = 3,
    grad_accum: int = 1,
    autocast_dtype: torch.dtype | None = None,
    rtol: float = FP32_RTOL,
    atol: float = FP32_ATOL,
    make_optimizer: Callable[..., torch.optim.Optimizer] = default_optimizer,
    loss_fn: Callable[[Any], torch.Tensor] = default_loss,
    seed: int = 0,
) -> ParityResult:
    """Train an eager and a ``torch.compile(model, backend=backend)`` copy of one model and
    assert they agree, step by step.

    Both copies share one initialisation (the compiled one is a deep copy) and see the same
    inputs (``make_inputs()`` called ``steps * grad_accum`` times under a fixed seed). After
    each optimizer step, outputs and losses of every micro-batch, the accumulated gradients,
    the parameters and the buffers (e.g. BatchNorm running statistics) must agree within
    ``rtol``/``atol``. Under ``autocast_dtype``, floating-point tensors are instead held to
    being about as accurate as eager autocast, measured against a third copy trained in fp32
    without autocast (see ``BF16_ERROR_MULTIPLIER``); integer tensors stay exact.

    Dropout parity needs ``torch._inductor.config.fallback_random=True`` (so the compiled
    graphs call the same aten random ops as eager); this function sets it for its run.
    Warnings raised while compiling and running are recorded (never raised) and returned,
    so callers can assert on the backend's warnings.
    """
    torch.manual_seed(seed)
    eager_model = make_model().train()
    compiled_model = copy.deepcopy(eager_model)
    reference_model = copy.deepcopy(eager_model)
    inputs = [[make_inputs() for _ in range(grad_accum)] for _ in range(steps)]
    train = dict(seed=seed, make_optimizer=make_optimizer, loss_fn=loss_fn)

    eager_records = _train(eager_model, eager_model, inputs, autocast_dtype=autocast_dtype, **train)
    reference_records = [None] * steps
    if autocast_dtype is not None:
        reference_records = _train(reference_model, reference_model, inputs, autocast_dtype=None, **train)
    counter = CompileCounterWithBackend(backend)
    with warnings.catch_warnings(record=True) as caught, torch._inductor.config.patch(fallback_random=True):
        warnings.simplefilter("always")
        compiled_forward = torch.compile(compiled_model, backend=counter)
        compiled_records = _train(compiled_model, compiled_forward, inputs, autocast_dtype=autocast_dtype, **train)

    assert counter.frame_count > 0, "torch.compile never called the backend"
    for step in range(steps):
        _assert_step_matches(step, compiled_records[step], eager_records[step], reference_records[step], rtol, atol)
    return ParityResult(eager_records, compiled_records, counter.frame_count, list(caught))


class CompiledFunction(torch.autograd.Function):
    """A stand-in compiled graph whose forward sleeps ``delay`` seconds: measured plan choice
    (``runtime/plan_trials.py``) finds the compiled backward among a step's autograd nodes by
    this name, as it finds AOTAutograd's."""

    @staticmethod
    def forward(ctx, x, delay):
        time.sleep(delay)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2, None
