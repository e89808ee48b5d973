"""Random small training programs for the hypothesis fuzzer (``tests/test_fuzz.py``).

A ``Program`` is the Python source of a ``forward(self, x0, ...)`` over 2-D tensors, plus
the submodules (Linear, LayerNorm, BatchNorm1d, a scale parameter) and inputs it needs.
Keeping the program as source means a failing example prints as code one can paste and
run, and hypothesis shrinks it op by op.

The ops cover what the partitioner has to get right: pointwise ops (add, mul, sin, tanh,
relu, gelu, sigmoid, exp of a bounded input), reductions (sum/mean over a dim, softmax,
log_softmax, layer_norm), matmuls and Linear, views (transpose, slices with an offset or a
step, expand into a pointwise op or made contiguous, split/unbind, reshape), in-place ops
on fresh intermediates (``add_``, ``mul_``, ``relu_``, ``mul_`` of a slice), dropout,
BatchNorm in train mode (buffer mutation), several outputs, and inputs shared by several
branches (every op picks its operands among all earlier values). Inputs may be
transposed (non-contiguous) and need not all require grad.
"""

from __future__ import annotations

import linecache
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count

import torch
import torch.nn.functional as F
from hypothesis import assume, strategies as st
from torch import nn

Shape = tuple[int, int]

MIN_SIZE, MAX_SIZE = 1, 5  # the range of most dimensions (see BATCH and WIDE)
# Rows an input may have besides small sizes, and widths a Linear may widen to: with many
# rows, activations outweigh parameters and their gradients, so the budget forces the
# planner to recompute or offload them.
BATCH = (32, 64)
WIDE = (16, 32)
MAX_OPS = 8
DROPOUT_P = (0.25, 0.5)
# Normalising a row or column whose entries are all equal (a broadcast, a size-1 dim)
# divides rounding noise by sqrt(eps): with the default 1e-5 that turns ulp-level
# differences between eager kernels and their decompositions into large ones. A large
# eps keeps every program well conditioned; the partitioner sees the same graph.
NORM_EPS = 0.1


@dataclass(frozen=True)
class InputSpec:
    name: str
    shape: Shape
    requires_grad: bool
    transposed: bool  # created as the transpose of a contiguous (cols, rows) tensor

    def describe(self) -> str:
        flags = [f for f, on in (("requires_grad", self.requires_grad), ("transposed", self.transposed)) if on]
        return f"{self.name}: {list(self.shape)} {' '.join(flags)}".rstrip()


@dataclass(frozen=True)
class ModuleSpec:
    name: str
    constructor: str  # Python expression building the submodule, e.g. "nn.Linear(4, 3, bias=True)"


@dataclass(frozen=True)
class Program:
    """A random forward function with its submodules and inputs (all of one dtype)."""

    dtype: torch.dtype
    inputs: tuple[InputSpec, ...]
    modules: tuple[ModuleSpec, ...]
    body: tuple[str, ...]  # lines of ``forward`` before the return
    outputs: tuple[str, ...]

    @property
    def source(self) -> str:
        args = ", ".join(["self", *(i.name for i in self.inputs)])
        lines = [f"def forward({args}):", *(f"    {line}" for line in self.body),
                 f"    return ({', '.join(self.outputs)},)"]
        return "\n".join(lines) + "\n"

    def __repr__(self) -> str:
        modules = [f"self.{m.name} = {m.constructor}" for m in self.modules]
        return "\n".join([
            f"Program({self.dtype}; inputs {'; '.join(i.describe() for i in self.inputs)})",
            *modules,
            self.source,
        ])

    def make_module(self, seed: int = 0) -> nn.Module:
        """A fresh module running this program, initialised from ``seed``."""
        forward = _compile_forward(self.source)
        module_class = type("FuzzProgram", (nn.Module,), {"forward": forward})
        module = module_class()
        torch.manual_seed(seed)
        for spec in self.modules:
            module.add_module(spec.name, eval(spec.constructor, {"nn": nn, "ScaleParameter": ScaleParameter}))
        return module.to(self.dtype).train()

    def make_inputs(self, seed: int = 0) -> list[torch.Tensor]:
        """Inputs drawn from ``seed`` (in float32, then cast: the same values whatever the
        dtype, up to rounding). They do not require grad yet: the caller sets that, see
        ``InputSpec.requires_grad``."""
        generator = torch.Generator().manual_seed(seed)
        tensors = []
        for spec in self.inputs:
            rows, cols = spec.shape
            if spec.transposed:
                tensors.append(torch.randn(cols, rows, generator=generator).to(self.dtype).t())
            else:
                tensors.append(torch.randn(rows, cols, generator=generator).to(self.dtype))
        return tensors


class ScaleParameter(nn.Module):
    """A learned per-column scale, used as ``self.scaleN.weight`` in programs."""

    def __init__(self, cols: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(cols))


_program_ids = count()


def _compile_forward(source: str) -> Callable:
    """The ``forward`` function of ``source``, registered with ``linecache`` so tracebacks
    and Dynamo's messages show the program's lines."""
    filename = f"<fuzz program {next(_program_ids)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"torch": torch, "F": F}
    exec(compile(source, filename, "exec"), namespace)
    return namespace["forward"]


# --------------------------------------------------------------------------- generation


@dataclass(frozen=True)
class Value:
    name: str
    shape: Shape
    requires_grad: bool


def _broadcasts_to(small: Shape, big: Shape) -> bool:
    return all(s == b or s == 1 for s, b in zip(small, big))


def _broadcast(a: Shape, b: Shape) -> Shape | None:
    if not all(x == y or x == 1 or y == 1 for x, y in zip(a, b)):
        return None
    return tuple(max(x, y) for x, y in zip(a, b))  # type: ignore[return-value]


@dataclass
class _Builder:
    """Accumulates the body of one program while ops are drawn."""

    draw: Callable
    values: list[Value] = field(default_factory=list)
    body: list[str] = field(default_factory=list)
    modules: list[ModuleSpec] = field(default_factory=list)
    read: set[str] = field(default_factory=set)  # names some op consumes
    _names: "count[int]" = field(default_factory=count)

    def emit(self, expression: str, shape: Shape, requires_grad: bool) -> Value:
        value = Value(f"v{next(self._names)}", shape, requires_grad)
        self.mark_read(expression)
        self.body.append(f"{value.name} = {expression}")
        self.values.append(value)
        return value

    def emit_pair(self, expression: str, shapes: tuple[Shape, Shape], requires_grad: bool) -> None:
        first, second = (Value(f"v{next(self._names)}", s, requires_grad) for s in shapes)
        self.mark_read(expression)
        self.body.append(f"{first.name}, {second.name} = {expression}")
        self.values += [first, second]

    def pick(self, where: Callable[[Value], bool] = lambda v: True) -> Value | None:
        """A value satisfying ``where``: the most recent one half the time (deep chains),
        else any, counted back from the most recent (programs shrink towards chains)."""
        choices = [v for v in self.values if where(v)]
        if not choices:
            return None
        return choices[-1 - self.draw(st.one_of(st.just(0), st.integers(0, len(choices) - 1)))]

    def sinks(self, first: int) -> list[Value]:
        """Values from index ``first`` on that no op reads: the program returns all of
        them, so no op is dead code."""
        return [v for v in self.values[first:] if v.name not in self.read]

    def mark_read(self, code: str) -> None:
        self.read.update(re.findall(r"\b[vx]\d+\b", code))

    def size(self) -> int:
        return self.draw(st.integers(MIN_SIZE, MAX_SIZE))

    def add_module(self, prefix: str, constructor: str) -> str:
        name = f"{prefix}{sum(m.name.startswith(prefix) for m in self.modules)}"
        self.modules.append(ModuleSpec(name, constructor))
        return name


# Each op draws its operands from the values built so far and returns False when it
# does not apply to them (the builder then emits a unary op instead). The list order is
# the order hypothesis shrinks towards: simplest first.

UNARY = (
    "torch.sin({})", "torch.tanh({})", "torch.relu({})", "torch.sigmoid({})", "F.gelu({})",
    "F.gelu({}, approximate='tanh')", "torch.exp(torch.tanh({}))", "({} * 0.5)",
)


def _unary(b: _Builder) -> bool:
    a = b.pick()
    b.emit(b.draw(st.sampled_from(UNARY)).format(a.name), a.shape, a.requires_grad)
    return True


def _binary(b: _Builder) -> bool:
    a = b.pick()
    other = b.pick(lambda v: _broadcast(v.shape, a.shape) is not None)
    operator = b.draw(st.sampled_from(("+", "*", "-")))
    shape = _broadcast(a.shape, other.shape)
    b.emit(f"{a.name} {operator} {other.name}", shape, a.requires_grad or other.requires_grad)
    return True


def _reduce(b: _Builder) -> bool:
    a = b.pick()
    dim = b.draw(st.sampled_from((0, 1)))
    kind = b.draw(st.sampled_from(("sum", "mean")))
    shape = (1, a.shape[1]) if dim == 0 else (a.shape[0], 1)
    b.emit(f"{a.name}.{kind}(dim={dim}, keepdim=True)", shape, a.requires_grad)
    return True


def _softmax(b: _Builder) -> bool:
    a = b.pick()
    dim = b.draw(st.sampled_from((0, 1)))
    kind = b.draw(st.sampled_from(("softmax", "log_softmax")))
    b.emit(f"torch.{kind}({a.name}, dim={dim})", a.shape, a.requires_grad)
    return True


def _layer_norm(b: _Builder) -> bool:
    a = b.pick()
    if b.draw(st.booleans()):
        name = b.add_module("ln", f"nn.LayerNorm({a.shape[1]}, eps={NORM_EPS})")
        b.emit(f"self.{name}({a.name})", a.shape, True)
    else:
        b.emit(f"F.layer_norm({a.name}, ({a.shape[1]},), eps={NORM_EPS})", a.shape, a.requires_grad)
    return True


def _linear(b: _Builder) -> bool:
    a = b.pick()
    out_features = b.draw(st.one_of(st.integers(MIN_SIZE, MAX_SIZE), st.sampled_from(WIDE)))
    bias = b.draw(st.booleans())
    name = b.add_module("lin", f"nn.Linear({a.shape[1]}, {out_features}, bias={bias})")
    b.emit(f"self.{name}({a.name})", (a.shape[0], out_features), True)
    return True


def _layer(b: _Builder) -> bool:
    """A Linear then an activation: chains of these save one activation per layer, which
    the backward needs one at a time, so recomputing or offloading them lowers the peak."""
    _linear(b)
    hidden = b.values[-1]
    b.emit(b.draw(st.sampled_from(UNARY)).format(hidden.name), hidden.shape, True)
    return True


def _matmul(b: _Builder) -> bool:
    a = b.pick()
    rows, inner = a.shape
    other = b.pick(lambda v: inner in v.shape)
    if other is None:
        return False
    grad = a.requires_grad or other.requires_grad
    if other.shape[0] == inner and b.draw(st.booleans()):
        b.emit(f"{a.name} @ {other.name}", (rows, other.shape[1]), grad)
    elif other.shape[1] == inner:
        b.emit(f"{a.name} @ {other.name}.t()", (rows, other.shape[0]), grad)
    else:
        b.emit(f"torch.mm({a.name}, {other.name})", (rows, other.shape[1]), grad)
    return True


def _scale(b: _Builder) -> bool:
    a = b.pick()
    name = b.add_module("scale", f"ScaleParameter({a.shape[1]})")
    b.emit(f"{a.name} * self.{name}.weight", a.shape, True)
    return True


def _transpose(b: _Builder) -> bool:
    a = b.pick()
    b.emit(b.draw(st.sampled_from(("{}.t()", "{}.transpose(0, 1)"))).format(a.name), a.shape[::-1], a.requires_grad)
    return True


def _slice(b: _Builder) -> bool:
    a = b.pick(lambda v: max(v.shape) >= 2)
    if a is None:
        return False
    dim = b.draw(st.sampled_from([d for d in (0, 1) if a.shape[d] >= 2]))
    size = a.shape[dim]
    kind = b.draw(st.sampled_from(("offset", "window", "step")))
    if kind == "offset":
        start = b.draw(st.integers(1, size - 1))
        index, new = f"{start}:", size - start
    elif kind == "window":
        start = b.draw(st.integers(0, size - 1))
        stop = b.draw(st.integers(start + 1, size))
        index, new = f"{start}:{stop}", stop - start
    else:
        index, new = "::2", (size + 1) // 2
    subscript = index if dim == 0 else f":, {index}"
    shape = (new, a.shape[1]) if dim == 0 else (a.shape[0], new)
    b.emit(f"{a.name}[{subscript}]", shape, a.requires_grad)
    return True


def _expand(b: _Builder) -> bool:
    """Broadcast a size-1 dim: the expanded view (stride 0) feeds a pointwise op with a
    value of the full shape, or is made contiguous."""
    a = b.pick(lambda v: 1 in v.shape)
    if a is None:
        return False
    target = tuple(b.size() if s == 1 else s for s in a.shape)
    expanded = f"{a.name}.expand({target[0]}, {target[1]})"
    partner = b.pick(lambda v: v.shape == target)
    if partner is not None and b.draw(st.booleans()):
        b.emit(f"{partner.name} * {expanded}", target, a.requires_grad or partner.requires_grad)
    elif b.draw(st.booleans()):
        b.emit(f"{expanded}.contiguous()", target, a.requires_grad)
    else:
        b.emit(expanded, target, a.requires_grad)
    return True


def _split(b: _Builder) -> bool:
    a = b.pick(lambda v: max(v.shape) >= 2)
    if a is None:
        return False
    dim = b.draw(st.sampled_from([d for d in (0, 1) if a.shape[d] >= 2]))
    size = a.shape[dim]
    first = b.draw(st.integers(1, size - 1))
    shapes = tuple((n, a.shape[1]) if dim == 0 else (a.shape[0], n) for n in (first, size - first))
    b.emit_pair(f"{a.name}.split([{first}, {size - first}], dim={dim})", shapes, a.requires_grad)
    return True


def _unbind(b: _Builder) -> bool:
    a = b.pick(lambda v: v.shape[1] % 2 == 0)
    if a is None:
        return False
    rows, cols = a.shape
    b.emit_pair(f"{a.name}.reshape({rows}, 2, {cols // 2}).unbind(1)", ((rows, cols // 2),) * 2, a.requires_grad)
    return True


def _reshape(b: _Builder) -> bool:
    a = b.pick()
    rows, cols = a.shape
    if (rows * cols) % 2 == 0 and b.draw(st.booleans()):
        b.emit(f"{a.name}.reshape(-1, 2)", (rows * cols // 2, 2), a.requires_grad)
    else:
        b.emit(f"{a.name}.reshape({cols}, {rows})", (cols, rows), a.requires_grad)
    return True


def _in_place(b: _Builder) -> bool:
    """An in-place op on a fresh intermediate (``a * 2.0`` saves nothing for backward,
    so mutating it is legal in eager autograd too)."""
    a = b.pick()
    fresh = b.emit(f"{a.name} * 2.0", a.shape, a.requires_grad)
    operand = b.pick(lambda v: v is not fresh and _broadcasts_to(v.shape, fresh.shape))
    choices = ["relu_()", "add_(0.5)", "mul_(0.5)"]
    if operand is not None:
        choices += [f"add_({operand.name})", f"mul_({operand.name})"]
    if fresh.shape[1] >= 2:
        choices.append("[:, 1:].mul_(1.5)")  # through a view with a storage offset
    op = b.draw(st.sampled_from(choices))
    b.mark_read(op)  # the operand; ``fresh`` itself is written, not read
    b.body.append(f"{fresh.name}{'' if op.startswith('[') else '.'}{op}")
    if operand is not None and operand.name in op and operand.requires_grad and not fresh.requires_grad:
        b.values[-1] = Value(fresh.name, fresh.shape, True)
    return True


def _dropout(b: _Builder) -> bool:
    """Dropout of a contiguous value. Its mask is drawn in memory order, and some of
    torch's decompositions (BatchNorm's) return a contiguous result where eager keeps a
    transposed input's layout: ``F.dropout(torch.sin(bn(x.t())))`` draws a different mask
    compiled than eager even under torch's own ``aot_eager_decomp_partition`` backend, so
    eager parity holds only for inputs of one layout."""
    a = b.pick()
    p = b.draw(st.sampled_from(DROPOUT_P))
    b.emit(f"F.dropout({a.name}.contiguous(), p={p}, training=True)", a.shape, a.requires_grad)
    return True


def _batch_norm(b: _Builder) -> bool:
    a = b.pick(lambda v: v.shape[0] >= 2)  # train-mode BatchNorm needs more than one row
    if a is None:
        return False
    name = b.add_module("bn", f"nn.BatchNorm1d({a.shape[1]}, eps={NORM_EPS})")
    b.emit(f"self.{name}({a.name})", a.shape, True)
    return True


# How often each op is drawn relative to the others: pointwise chains on wide values are
# what give the planner recompute and offload choices.
WEIGHTS = {"unary": 4, "binary": 2, "linear": 2, "layer": 3}

OPS: dict[str, Callable[[_Builder], bool]] = {
    "unary": _unary, "binary": _binary, "reduce": _reduce, "softmax": _softmax, "layer_norm": _layer_norm,
    "linear": _linear, "layer": _layer, "matmul": _matmul, "scale": _scale, "transpose": _transpose, "slice": _slice,
    "expand": _expand, "split": _split, "unbind": _unbind, "reshape": _reshape, "in_place": _in_place,
    "dropout": _dropout, "batch_norm": _batch_norm,
}


@st.composite
def programs(draw, dtypes=(torch.float32, torch.float64), min_ops: int = 1, max_ops: int = MAX_OPS,
             ops=tuple(OPS)) -> Program:
    """Random programs of ``min_ops`` to ``max_ops`` ops drawn from ``ops`` (names in
    ``OPS``), returning every value no op reads; programs none of whose outputs needs a
    gradient are rejected (``assume``)."""
    builder = _Builder(draw)
    num_inputs = draw(st.integers(1, 3))
    inputs = []
    for index in range(num_inputs):
        # x0 always requires grad, so (nearly) every program has a backward.
        requires_grad = index == 0 or draw(st.booleans())
        rows = draw(st.one_of(st.integers(MIN_SIZE, MAX_SIZE), st.sampled_from(BATCH)))
        spec = InputSpec(f"x{index}", (rows, builder.size()), requires_grad, draw(st.booleans()))
        inputs.append(spec)
        builder.values.append(Value(spec.name, spec.shape, requires_grad))
    weighted = [name for name in ops for _ in range(WEIGHTS.get(name, 1))]
    for _ in range(draw(st.integers(min_ops, max_ops))):
        if not OPS[draw(st.sampled_from(weighted))](builder):
            _unary(builder)
    outputs = builder.sinks(num_inputs)
    assume(any(v.requires_grad for v in outputs))
    return Program(
        dtype=draw(st.sampled_from(dtypes)),
        inputs=tuple(inputs),
        modules=tuple(builder.modules),
        body=tuple(builder.body),
        outputs=tuple(v.name for v in outputs),
    )


def program_from_source(source: str, dtype: torch.dtype, inputs: list[InputSpec],
                        modules: dict[str, str] | None = None) -> Program:
    """A hand-written Program (for explicit regression examples): ``source`` is a
    ``forward`` whose last line returns a tuple of names."""
    lines = textwrap.dedent(source).strip().splitlines()
    header, *body, ret = lines
    assert header.startswith("def forward(") and ret.strip().startswith("return ("), source
    outputs = tuple(n.strip() for n in ret.strip()[len("return ("):-1].split(",") if n.strip())
    return Program(dtype, tuple(inputs), tuple(ModuleSpec(n, c) for n, c in (modules or {}).items()),
                   tuple(line.strip() for line in body), outputs)


# Ops whose backward reads their input: a tensor and a view of it read by two of these are
# both needed by the backward.
READS_INPUT = ("torch.sin({0})", "F.gelu({0})", "({0} * {0})", "F.gelu({0}, approximate='tanh')")


def _view_read(b: _Builder, a: Value) -> Value:
    """A view of ``a`` (transposed, reshaped, or a slice) read by an op whose backward reads
    its input, so the backward needs the view as well as what else reads ``a``."""
    rows, cols = a.shape
    kinds = ["t", "reshape"] + ["rows"] * (rows >= 2) + ["columns", "split"] * (cols >= 2)
    kind = b.draw(st.sampled_from(kinds))
    if kind == "t":
        view, shape = f"{a.name}.t()", (cols, rows)
    elif kind == "reshape":
        view, shape = f"{a.name}.reshape({cols}, {rows})", (cols, rows)
    elif kind == "rows":
        view, shape = f"{a.name}[1:]", (rows - 1, cols)
    elif kind == "columns":
        view, shape = f"{a.name}[:, ::2]", (rows, (cols + 1) // 2)
    else:
        view, shape = f"{a.name}.split([1, {cols - 1}], dim=1)[1]", (rows, cols - 1)
    return b.emit(b.draw(st.sampled_from(READS_INPUT)).format(view), shape, a.requires_grad)


@st.composite
def aliased_programs(draw, dtypes=(torch.float64,), max_layers: int = 3) -> Program:
    """Programs whose backward needs tensors and views of them: layers of a Linear (an
    ``addmm``) whose output is read, in a random order, through views by ops whose backward
    reads their input, directly by such an op, and by a residual add, then any op of
    ``OPS``."""
    b = _Builder(draw)
    rows = draw(st.sampled_from((2, 4, *BATCH)))
    x0 = InputSpec("x0", (rows, b.size()), True, draw(st.booleans()))
    b.values.append(Value(x0.name, x0.shape, True))
    for _ in range(draw(st.integers(1, max_layers))):
        a = b.pick()
        residual = draw(st.booleans())
        width = a.shape[1] if residual else draw(st.one_of(st.integers(2, MAX_SIZE), st.sampled_from(WIDE)))
        name = b.add_module("lin", f"nn.Linear({a.shape[1]}, {width})")
        h = b.emit(f"self.{name}({a.name})", (a.shape[0], width), True)
        readers = draw(st.lists(st.sampled_from(("view", "view", "direct", "residual")), min_size=2, max_size=4))
        for reader in readers:
            if reader == "view":
                _view_read(b, h)
            elif reader == "direct" or not residual:
                b.emit(draw(st.sampled_from(READS_INPUT)).format(h.name), h.shape, True)
            else:
                b.emit(draw(st.sampled_from(READS_INPUT)).format(f"({a.name} + {h.name})"), h.shape, True)
        if draw(st.booleans()):
            OPS[draw(st.sampled_from(list(OPS)))](b) or _unary(b)
    return Program(
        dtype=draw(st.sampled_from(dtypes)),
        inputs=(x0,),
        modules=tuple(b.modules),
        body=tuple(b.body),
        outputs=tuple(v.name for v in b.sinks(1)),
    )
