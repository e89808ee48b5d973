"""Dynamic shapes: check the plan's predicted peak at each new size against the budget.

With ``torch.compile(dynamic=True)`` (or a dimension Dynamo made dynamic after a
recompile) one graph serves every size, and its plan is made once, for one size of each
size symbol: the one named with ``mark_dynamic(..., hint_override=n)``, else the largest its
frame was compiled at before (``plan_at_largest_sizes``, below), else the size of the call
that compiled it. A byte budget met at batch 512 can then be exceeded several times over
at batch 4096. The plan's memory program (the steps of the forward and backward and what
each allocates) is kept with every allocation as an expression in the graph's size
symbols; at the first call with new sizes the program is simulated again at those sizes
(``passes.memory.peak_bytes``). When the predicted peak exceeds the budget at sizes larger
than planned, that call runs the plan it has and warns, and the frame is compiled again by
Dynamo at its next call, planned for those sizes (``replan_when_larger``, at most
``MAX_REPLANS`` times a graph); otherwise one warning per graph says so.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..passes.analyze import JointAnalysis, tensor_value
from ..passes.compat import size_hint
from ..passes.memory import Program, Step, plan_program
from ..passes.memory import peak_bytes as memory_peak_bytes
from ..passes.plan import format_bytes
from ..settings import Settings
from ..torch_api.dynamo import config as dynamo_config
from ..torch_api.dynamo import graph_input_sources
from ..torch_api.guards import compile_id, frame_begun
from .ddp import bucket_index
from .result import BudgetError

log = logging.getLogger("compile_offload")


@dataclass
class SymbolicProgram:
    """A plan's memory program with sizes as expressions (strings, ``sympy`` syntax) in
    the graph's size symbols; JSON-able, so a cache hit can check sizes too."""

    # per step: (allocations, reads, in-place candidates), storages by index
    steps: list[tuple[list[tuple[int, str]], list[int], list[int]]]
    outlives: list[int]
    backward_start: int
    symbols: list[str]  # the size symbols the expressions use
    _parsed_symbols: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)
    _parsed: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)
    _steps: list | None = field(default=None, init=False, repr=False, compare=False)

    def to_json(self) -> dict:
        return {"steps": self.steps, "outlives": self.outlives, "backward_start": self.backward_start,
                "symbols": self.symbols}

    @classmethod
    def from_json(cls, data: dict) -> "SymbolicProgram":
        steps = [([(int(k), str(e)) for k, e in step[0]], [int(r) for r in step[1]],
                  [int(c) for c in (step[2] if len(step) > 2 else ())]) for step in data["steps"]]
        return cls(steps, [int(k) for k in data["outlives"]], int(data["backward_start"]), list(data["symbols"]))

    def peak_bytes(self, sizes: dict[str, int]) -> int:
        """The predicted peak with each symbol at ``sizes[name]``."""
        values = {symbol: sizes[name] for name, symbol in self._symbols().items() if name in sizes}
        bytes_of = {text: int(expr.xreplace(values)) for text, expr in self._expressions().items()}
        steps = [Step("", [(key, bytes_of[text]) for key, text in allocs], reads, in_place=in_place)
                 for allocs, reads, in_place in self._structure()]
        return memory_peak_bytes(Program(steps, self.backward_start, set(self.outlives)))

    # Parsed once per program: a training loop with a new length every step checks each one.
    def _symbols(self) -> dict[str, Any]:
        if self._parsed_symbols is None:
            import sympy

            self._parsed_symbols = {name: sympy.Symbol(name, integer=True) for name in self.symbols}
        return self._parsed_symbols

    def _expressions(self) -> dict[str, Any]:
        """Each distinct size expression's text -> its sympy expression."""
        if self._parsed is None:
            import sympy

            from ..torch_api.utils import sympy_functions as size_functions  # FloorDiv, Mod, ... as torch prints them

            names = {name: getattr(size_functions, name) for name in dir(size_functions)
                     if isinstance(getattr(size_functions, name), type)}
            names.update(self._symbols())
            texts = {text for allocs, _, _ in self.steps for _, text in allocs}
            self._parsed = {text: sympy.sympify(text, locals=names) for text in texts}
        return self._parsed

    def _structure(self) -> list[tuple[list[tuple[int, str]], list[int], tuple[int, ...]]]:
        if self._steps is None:
            self._steps = [([(int(key), text) for key, text in allocs], list(reads), tuple(in_place))
                           for allocs, reads, in_place in self.steps]
        return self._steps


def _expression(value: Any) -> Any:
    import sympy

    if isinstance(value, torch.SymInt):
        return value.node.expr
    return sympy.Integer(int(value))


def _storage_bytes(node: fx.Node | None, nbytes: int) -> str:
    """The bytes a storage of ``node`` takes, as an expression in the size symbols (as
    ``passes.analyze.allocation_bytes`` counts them); ``nbytes`` when not symbolic."""
    val = tensor_value(node) if node is not None else None
    if val is None or all(isinstance(s, int) for s in (*val.shape, *val.stride())):
        return str(nbytes)
    extent = 1
    for size, stride in zip(val.shape, val.stride()):
        extent = extent + (_expression(size) - 1) * _expression(stride)
    return str(extent * val.element_size())


def symbolic_program(a: JointAnalysis, saved: set[fx.Node], offloaded: set[fx.Node] = frozenset(),
                     transfers: Any = None) -> SymbolicProgram | None:
    """The chosen plan's program with symbolic sizes; None when the graph has no symbolic
    size (nothing to check)."""
    symbols: set[str] = set()
    for node in a.joint.gm.graph.nodes:
        val = tensor_value(node)
        if val is not None:
            for size in (*val.shape, *val.stride()):
                if isinstance(size, torch.SymInt):
                    symbols.update(str(s) for s in size.node.expr.free_symbols)
    if not symbols:
        return None
    program = plan_program(
        a, saved, offloaded, fusion=a.fusion,
        reload_distance=transfers.reload_distance if transfers else None,
        offload_wait_after=transfers.offload_wait_after if transfers else None,
    )
    index: dict[Any, int] = {}
    steps = []
    for step in program.steps:
        allocs = []
        for key, nbytes in step.allocates:
            node = key if isinstance(key, fx.Node) else next((k for k in key if isinstance(k, fx.Node)), None)
            expr = _storage_bytes(node, nbytes)
            allocs.append((index.setdefault(key, len(index)), expr))
        reads = [index.setdefault(key, len(index)) for key in step.reads]
        steps.append((allocs, reads, [index.setdefault(key, len(index)) for key in step.in_place]))
    outlives = [index.setdefault(key, len(index)) for key in program.outlives]
    return SymbolicProgram(steps, outlives, program.backward_start, sorted(symbols))


def _symbol_locations(example_inputs: Sequence[Any]) -> dict[str, tuple[int, int | None]]:
    """Where each plain size symbol can be read from a call's arguments: (argument, dim),
    dim None for a SymInt argument."""
    where: dict[str, tuple[int, int | None]] = {}
    for position, value in enumerate(example_inputs):
        if _plain_symbol(value) is not None:
            where.setdefault(str(_plain_symbol(value)), (position, None))
        elif isinstance(value, torch.Tensor):
            for dim, size in enumerate(value.shape):
                if _plain_symbol(size) is not None:
                    where.setdefault(str(_plain_symbol(size)), (position, dim))
    return where


def check_sizes(compiled: Callable[..., Any], example_inputs: Sequence[Any], programs: list[SymbolicProgram],
                budget_bytes: int | Callable[[], int | None] | None, graph_name: str,
                gm: torch.fx.GraphModule | None = None, strict: bool = False) -> Callable[..., Any]:
    """``compiled``, checking the predicted peak of each new set of sizes against
    ``budget_bytes`` and warning once when a size exceeds it. Where ``gm`` is the graph
    Dynamo is compiling and the size is above the one planned for, the frame is compiled
    again at its next call, planned for that size (``replan_when_larger``), and the warning
    says so. ``compiled`` itself when there is nothing to check (no byte budget, no symbolic
    size, or a symbol that cannot be read from the arguments).

    ``budget_bytes`` may be a function giving the budget at the call (None: not known yet,
    nothing checked): under ``budget_scope="step"`` a graph's minimum-memory plan, which runs
    every size but the one its share's plan was compiled for, is checked against its share of
    the step's budget once the split has made it. A budget of 0 asks for the minimum-memory
    plan, which every size runs as it is: nothing to check.

    ``strict`` (``strict_budget``): a call at sizes predicted over the budget raises
    ``BudgetError`` instead of running, every time (the frame is still compiled again for
    them, once; where that compile raises too, this graph serves the sizes it can again)."""
    if budget_bytes is None or budget_bytes == 0 or not programs:
        return compiled
    where = _symbol_locations(example_inputs)
    symbols = sorted({s for program in programs for s in program.symbols})
    if not symbols:
        return compiled
    unread = [s for s in symbols if s not in where]  # data-dependent sizes (planned at their bounds), or:
    if unread and any(isinstance(value, torch.Tensor) and value.is_nested for value in example_inputs):
        # a nested tensor's ragged size: no argument holds it
        warnings.warn(f"compile_offload: {graph_name}: dynamic shapes: the sizes {', '.join(unread)} cannot be read "
                      "from the call's inputs (a nested tensor's ragged size): calls at other sizes than those "
                      "planned are not checked against the memory budget"
                      + (", and strict_budget cannot refuse them" if strict else ""), stacklevel=2)
    if unread:
        return compiled
    hints = {s: _read(example_inputs, where[s], size_hint) for s in symbols}
    planned = tuple(hints[s] for s in symbols)
    replan = replan_when_larger(gm) if gm is not None else None
    peaks: dict[tuple, int | None] = {}  # (sizes, limit) checked -> the predicted peak (None: not computed)
    refused: dict[tuple[int, ...], str] = {}  # sizes the frame's compile for them raised at -> the sizes planned
    not_again: dict[tuple[int, ...], str] = {}  # strict: sizes the frame was not compiled again for, and why
    unchecked: list[tuple[int, ...]] = []  # the first sizes whose peak could not be computed (warned)
    warned = False
    boxed = getattr(compiled, "_boxed_call", False)

    share = callable(budget_bytes)
    strict = strict and not share  # a share's minimum-memory plan: the step budget's own rules

    @functools.cache
    def planned_peak() -> int | None:
        try:
            return max(program.peak_bytes(hints) for program in programs)
        except (TypeError, ValueError, SyntaxError):
            return None

    @functools.wraps(compiled)
    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal warned
        limit = budget_bytes() if share else budget_bytes
        if (strict or not warned) and limit:  # None: not split yet; 0: the minimum-memory plan asked for
            # Read before the call: a boxed call (one list) may clear the list.
            inputs = args[0] if boxed and len(args) == 1 and isinstance(args[0], list) else args
            sizes = tuple(_read(inputs, where[s]) for s in symbols)
            first = (sizes, limit) not in peaks
            if (first or strict) and sizes != planned:  # the planned sizes: the plan's own warning, if any
                # (not strict: each set of sizes is checked at its first call; strict: each call)
                at = dict(zip(symbols, sizes))
                if first:
                    try:
                        peaks[sizes, limit] = max(program.peak_bytes(at) for program in programs)
                    except (TypeError, ValueError, SyntaxError) as error:  # an expression sympy cannot evaluate
                        peaks[sizes, limit] = None
                        if not unchecked and not strict:  # once per graph: its other sizes may not evaluate either
                            unchecked.append(sizes)
                            warnings.warn(f"compile_offload: {graph_name}: dynamic shapes: the plan's peak at "
                                          f"{_sizes(at)} could not be computed ({type(error).__name__}: {error}); "
                                          "these sizes are not checked against the memory budget", stacklevel=2)
                peak = peaks[sizes, limit]
                if strict and (peak is None or peak > limit):  # not known to fit: not run, each time
                    larger = {s: at[s] for s in symbols if at[s] > hints[s]}
                    if sizes in refused:
                        why = (f" (the graph compiled again for {refused[sizes]}, which covers these sizes and "
                               "those planned, raised: no plan for them fits either; dynamic=False plans each size "
                               "on its own)")
                    elif first and replan is not None and larger:  # a graph planned for them may fit
                        covering = _sizes({**hints, **larger})
                        again = replan(larger, hints, lambda: refused.__setitem__(sizes, covering))
                        why = ("; the next call compiles the graph again, planned for these sizes"
                               if isinstance(again, int) else f" (not compiled again: {again})")
                        not_again[sizes] = "" if isinstance(again, int) else why
                    else:
                        why = not_again.get(sizes, "")
                    found = (f": its peak could not be computed, so it is not known to fit the memory budget "
                             f"{format_bytes(limit)}" if peak is None else
                             f" has a predicted peak of {format_bytes(peak)}, above the memory budget "
                             f"{format_bytes(limit)}")
                    raise BudgetError(
                        f"compile_offload: {graph_name}: dynamic shapes: at {_sizes(at)} the plan made for "
                        f"{_sizes(hints)}{found}; strict_budget=True: this call does not run{why}")
                if peak is None:  # not strict: said unchecked (once per graph)
                    return compiled(*args, **kwargs)
                if peak > limit and not share and peak <= (planned_peak() or -1):
                    # no more than at the planned sizes, over the budget there too: the plan's own
                    # warning (below the minimum, over budget) said so; naming a size cannot help
                    return compiled(*args, **kwargs)
                if peak > limit and share:
                    warned = True
                    warnings.warn(
                        f"compile_offload: {graph_name}: budget_scope='step' with dynamic shapes: at {_sizes(at)} this "
                        f"graph runs its minimum-memory plan (its share's plan serves only the sizes it was compiled "
                        f"for), with a predicted peak of {format_bytes(peak)}, above its share "
                        f"{format_bytes(limit)} of the step's memory budget (warned once per graph). Make the first "
                        "calls at the largest size, or compile with dynamic=False so that each size gets its own "
                        "share's plan (a compile per size, up to torch._dynamo.config.recompile_limit)",
                        stacklevel=2)
                elif peak > limit:
                    warned = True
                    larger = {s: at[s] for s in symbols if at[s] > hints[s]}
                    again = replan(larger, hints) if replan is not None and larger else None
                    head = (f"compile_offload: {graph_name}: dynamic shapes: at {_sizes(at)} the plan made for "
                            f"{_sizes(hints)} has a predicted peak of {format_bytes(peak)}, above the memory budget "
                            f"{format_bytes(limit)}")
                    avoid = ("name the largest with torch._dynamo.mark_dynamic(x, dim, hint_override=largest) "
                             "before the first call, or make the first call with the largest size")
                    if isinstance(again, int):
                        warnings.warn(f"{head}. This call runs it; the next call compiles the graph again, planned "
                                      f"for these sizes (compiled again for a larger size {again} of at most "
                                      f"{MAX_REPLANS} times). To plan for the largest size from the start, {avoid}",
                                      stacklevel=2)
                    else:
                        warnings.warn(
                            f"{head} (warned once per graph). A dynamic graph has one plan, made for one size"
                            + (f", and {again}" if again else "")
                            + f": {avoid}, or compile with dynamic=False so that each size gets a plan of its own "
                            "(a compile per size, up to torch._dynamo.config.recompile_limit)",
                            stacklevel=2,
                        )
        return compiled(*args, **kwargs)

    return run


def for_the_sizes_of(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], compiled: Callable[..., Any], *,
                     otherwise: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled``, where ``gm`` has no symbolic size; else a function that runs
    ``compiled`` for calls with exactly the sizes and strides of ``example_inputs`` (those it
    was compiled for, compiled again outside Dynamo: ``budget_scope="step"``) and
    ``otherwise`` (the graph as Dynamo compiled it, for every size) for the rest.

    Only the arguments whose sizes Dynamo made symbolic are compared: Dynamo's guards hold
    the others. ``example_inputs`` are a call's own arguments (ints where Dynamo's were size
    symbols, whose hint ``mark_dynamic(..., hint_override=n)`` would set to n)."""
    traced = _traced_values(gm, len(example_inputs))
    if not any(_symbolic(value if value is not None else real) for real, value in zip(example_inputs, traced)):
        return compiled
    # An input the graph does not describe is compared whole.
    checked = [i for i, (real, value) in enumerate(zip(example_inputs, traced))
               if _symbolic(value) or (value is None and isinstance(real, (torch.Tensor, int, torch.SymInt)))]
    expected = tuple(_key(example_inputs[i]) for i in checked)

    @functools.wraps(compiled)
    def run(*args: Any) -> Any:
        return (compiled if tuple(_key(args[i]) for i in checked) == expected else otherwise)(*args)

    return run


def _traced_values(gm: torch.fx.GraphModule, count: int) -> list[Any]:
    """Each input's value as Dynamo traced it (a fake tensor or a SymInt, from the
    placeholder's ``example_value``), None where the graph does not say."""
    values = [node.meta.get("example_value") for node in gm.graph.nodes if node.op == "placeholder"]
    return values if len(values) == count else [None] * count


def _symbolic(value: Any) -> bool:
    """Whether ``value`` is a size symbol, or a tensor with a symbolic size or stride."""
    if isinstance(value, torch.Tensor):
        return any(isinstance(s, torch.SymInt) for s in (*value.shape, *value.stride()))
    return isinstance(value, torch.SymInt)


def _key(value: Any) -> Any:
    """A tensor's sizes and strides, an int's value (``size_hint`` for a symbolic one)."""
    if isinstance(value, torch.Tensor):
        return tuple(size_hint(s) for s in value.shape), tuple(size_hint(s) for s in value.stride())
    return size_hint(value) if isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool) else None


def _read(inputs: Sequence[Any], location: tuple[int, int | None], to_int: Callable[[Any], int] = int) -> int:
    position, dim = location
    value = inputs[position]
    return to_int(value if dim is None else value.shape[dim])


def _sizes(values: dict[str, int]) -> str:
    return ", ".join(f"{name}={value}" for name, value in values.items())


def program_of(result: Any) -> SymbolicProgram | None:
    """The symbolic program of a ``PartitionResult`` (None: not planned, or static sizes)."""
    a = result.analysis
    if a is None:
        return None
    chosen = result.solution.chosen if result.solution is not None else None
    if chosen is not None:
        return symbolic_program(a, set(chosen.saved), set(chosen.offloaded), chosen.transfers)
    by_name = {node.name: node for node in a.joint.gm.graph.nodes}  # a plan from the plan cache
    return symbolic_program(a, {by_name[n] for n in result.plan.saved}, {by_name[n] for n in result.plan.offloaded})


# --- the sizes a dynamic graph is planned for ----------------------------------------------------
#
# Dynamo compiles a frame for the sizes of its first call and, when a call comes with another
# size, compiles it again with that dimension as a size symbol (automatic dynamic shapes),
# hinted at the size of that call. A training loop whose last batch is smaller (a
# ``DataLoader`` without ``drop_last``) thus gets its dynamic graph at the small batch, and that
# graph then serves every full batch after it: a plan made for the small batch exceeds a byte
# budget at the full one. So each training compile (grad on, an input that requires grad)
# records the sizes of its tensor inputs by source (``L['x']``) and dimension, together, per
# frame (an evaluation under ``no_grad`` at a larger batch is not counted), and a graph with
# size symbols is planned at the recorded sizes that cover the others (``Settings.planning_sizes``,
# read through ``passes.compat.planning_sizes``):
#
# - where one record is at least as large as every other in every dimension, at it;
# - where none is (two dimensions vary: batch 32 x sequence 128, then 12 x 512), at the record
#   with the most input elements, and the plan's predicted peak is checked at each other
#   record (``Settings.sizes_to_cover``); where one is over the budget, the graph is planned
#   again at the next record (``sizes_covering_all``), and after ``MAX_SIZES_TRIED`` at each
#   dimension's largest: a combination no call had, but one that covers them all.
#
# A symbol is planned at a recorded size only within its range and where no ``hint_override``
# names another. Frames are Dynamo's, so instances of one module class share them, as they
# share Dynamo's compiled code; ``torch._dynamo.reset()`` numbers frames from 0 again, so a
# frame's first compile in a new compile context forgets what its number recorded before.

Record = dict[tuple[str, int], int]  # (input source, dimension) -> size
# Dynamo frame id -> the sizes of its training compiles, and of the calls it was compiled again for
_records: dict[int, list[Record]] = {}
# At most this many records a frame (the oldest go first); Dynamo's recompile_limit bounds it too.
MAX_RECORDS = 64
# Dynamo frame id -> the compile context of its first compile (DDPOptimizer's bucket graphs share one)
_first_compile: dict[int, weakref.ref] = {}


def plan_at_largest_sizes(gm: torch.fx.GraphModule, settings: Settings, graph_name: str) -> Settings:
    """``settings`` with ``planning_sizes`` naming the size symbols of ``gm``'s inputs to plan
    at sizes an earlier training compile of the same frame had (where there is a budget),
    and ``sizes_to_cover`` the other records' sizes where none covers them all; records
    ``gm``'s sizes."""
    frame = _frame_id()
    # A nested (jagged) tensor's ragged size is no size a call has: its components, which the
    # joint graph plans, are recorded where they are inputs of their own.
    tensors = [(source, value) for source, value in graph_input_sources(gm)
               if isinstance(value, torch.Tensor) and not value.is_nested]
    if frame is None or not torch.is_grad_enabled() or not any(value.requires_grad for _, value in tensors):
        return settings  # not a training graph
    own: Record = {(source, dim): size_hint(size) for source, value in tensors for dim, size in enumerate(value.shape)}
    locations: dict[str, list[tuple[str, int]]] = {}
    symints: dict[str, torch.SymInt] = {}
    for source, value in tensors:
        for dim, size in enumerate(value.shape):
            symbol = _plain_symbol(size)
            if symbol is not None:
                locations.setdefault(symbol.name, []).append((source, dim))
                symints[symbol.name] = size
    earlier = list(_records.get(frame, ()))
    _record(frame, own)
    if not locations or not earlier or not settings.has_budget:
        return settings
    hints = {name: size_hint(symints[name]) for name in locations}

    def assigned(record: Record) -> dict[str, int]:
        sizes = {}
        for name, where in locations.items():
            seen = max((record[loc] for loc in where if loc in record), default=hints[name])
            sizes[name] = seen if _may_plan_at(symints[name], symints[name].node.expr, seen) else hints[name]
        return sizes

    candidates = _distinct([hints] + [assigned(record) for record in reversed(earlier)])
    largest = {name: max(c[name] for c in candidates) for name in locations}
    if largest in candidates:  # one record covers the rest
        planning, cover = tuple(sorted((n, size) for n, size in largest.items() if size != hints[n])), ()
    else:  # tried in turn, most input elements first
        uncovered = [c for c in candidates if not any(_covers(d, c) and d != c for d in candidates)]
        uncovered.sort(key=lambda c: (_input_elements(tensors, c), sorted(c.items())), reverse=True)
        planning, cover = tuple(sorted(uncovered[0].items())), tuple(tuple(sorted(c.items())) for c in uncovered)
    if not planning:
        return settings
    log.info("%s: dynamic sizes planned at sizes this frame was compiled at: %s", graph_name,
             ", ".join(f"{name}={size}" for name, size in planning))
    return dataclasses.replace(settings, planning_sizes=planning, sizes_to_cover=cover)


def sizes_planned_at(gm: fx.GraphModule, settings: Settings) -> tuple[tuple[str, int], ...]:
    """Each size symbol of ``gm``'s inputs with the size its plan is made at: the one
    ``settings.planning_sizes`` names, else its hint (a ``hint_override``'s, where one names it).
    A dynamic graph's plan depends on them, yet neither Dynamo's graph nor the call's tensors
    tell them apart (``mark_dynamic(x, 0, hint_override=2048)`` on a batch of 512 is planned at
    2048, a plain dynamic compile of the same batch at 512): the keys compiled code and its
    records are stored under carry them (the partitioner's ``uuid``, ``graph_reports.record_key``),
    so code planned at one size is never served to a compile that plans at another."""
    named = dict(settings.planning_sizes)
    sizes: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta.get("example_value", node.meta.get("val"))
        dims = value.shape if isinstance(value, torch.Tensor) else (value,) if isinstance(value, torch.SymInt) else ()
        for size in dims:
            symbol = _plain_symbol(size)
            if symbol is not None:
                sizes[symbol.name] = named.get(symbol.name, size_hint(size))
    return tuple(sorted(sizes.items()))


# Of several recorded sizes none of which covers the others, at most this many are planned
# for in turn before the graph is planned at each dimension's largest.
MAX_SIZES_TRIED = 3


def sizes_covering_all(settings: Settings, programs: list[SymbolicProgram], graph_name: str) -> Settings | None:
    """Where the graph was planned at one of several recorded sizes none of which covers the
    others (``Settings.sizes_to_cover``) and the plan's predicted peak at another exceeds the
    byte budget: ``settings`` planning at the next of them, or, after ``MAX_SIZES_TRIED``,
    at each size symbol's largest recorded size (a combination no call may have had, but one
    that covers them all). Else None: the plan keeps the budget at every recorded size."""
    if not settings.sizes_to_cover or not settings.budget_bytes or not programs:  # 0: the minimum-memory plan
        return None
    planned = settings.planning_sizes
    over = None
    for sizes in settings.sizes_to_cover:
        if sizes == planned:
            continue
        try:
            peak = max(program.peak_bytes(dict(sizes)) for program in programs)
        except (TypeError, ValueError, SyntaxError, KeyError) as error:  # a size sympy cannot evaluate
            log.debug("%s: no peak check at %s (%s)", graph_name, _sizes(dict(sizes)), error)
            continue
        if peak > settings.budget_bytes:
            over = (sizes, peak)
            break
    if over is None:
        return None
    tried = settings.sizes_to_cover.index(planned) + 1 if planned in settings.sizes_to_cover else len(settings.sizes_to_cover)
    if tried < min(MAX_SIZES_TRIED, len(settings.sizes_to_cover)):
        again, cover = settings.sizes_to_cover[tried], settings.sizes_to_cover
    else:
        largest: dict[str, int] = {}
        for sizes in settings.sizes_to_cover:
            for name, size in sizes:
                largest[name] = max(largest.get(name, size), size)
        again, cover = tuple(sorted(largest.items())), ()
    log.info("%s: the plan made for %s has a predicted peak of %s at %s, sizes this frame was compiled at, above the "
             "memory budget %s: planned again for %s%s", graph_name, _sizes(dict(planned)), format_bytes(over[1]),
             _sizes(dict(over[0])), format_bytes(settings.budget_bytes), _sizes(dict(again)),
             "" if cover else " (each size at the largest recorded)")
    return dataclasses.replace(settings, planning_sizes=again, sizes_to_cover=cover)


def _record(frame: int, sizes: Record) -> None:
    records = _records.setdefault(frame, [])
    if sizes in records:
        records.remove(sizes)
    records.append(sizes)
    del records[:-MAX_RECORDS]


def _distinct(candidates: list[dict[str, int]]) -> list[dict[str, int]]:
    found: list[dict[str, int]] = []
    for candidate in candidates:
        if candidate not in found:
            found.append(candidate)
    return found


def _covers(a: dict[str, int], b: dict[str, int]) -> bool:
    return all(a[name] >= b[name] for name in b)


def _input_elements(tensors: list[tuple[str, torch.Tensor]], sizes: dict[str, int]) -> int:
    """The elements of the graph's symbolically sized inputs with its size symbols at ``sizes``."""
    total = 0
    for _, value in tensors:
        if not any(isinstance(size, torch.SymInt) for size in value.shape):
            continue
        count = 1
        for size in value.shape:
            symbol = _plain_symbol(size)
            count *= sizes[symbol.name] if symbol is not None and symbol.name in sizes else size_hint(size)
        total += count
    return total


# A dynamic graph compiled again for a larger size, at most this many times.
MAX_REPLANS = 3
# (Dynamo frame id, DDP bucket graph or 0) -> for each compile of the frame asked for and not
# yet made, how many times the graph it replaces had been compiled again for a larger size.
# One frame may compile several graphs of their own (the layers of a model compiled per layer
# share their code and differ by a guard on the module), so the count goes with each graph's
# line of compiles; DDPOptimizer's bucket graphs of one compile each have their own line.
# (frame, DDP bucket) -> for each compile asked for, in order: (the graph's compiles again so
# far, an undo of the ask: where that compile raises, the graph that asked serves again)
_replans: dict[tuple[int, int], list[tuple[int, Callable[[], None]]]] = {}


def replan_when_larger(gm: torch.fx.GraphModule) -> Callable[[dict[str, int], dict[str, int]], int | str] | None:
    """For the graph Dynamo is compiling: a function that, given the sizes of its size
    symbols that grew above those planned for and broke the budget, and the sizes planned
    for, records those planned with the grown ones raised as sizes of the frame
    (``plan_at_largest_sizes``: they cover every earlier record) and makes the frame's guard fail, so
    that Dynamo compiles the frame again at its next call and that graph is planned for those
    sizes; it returns how many times the frame was compiled again so, or why it may not
    (``MAX_REPLANS`` reached, or ``hint_override`` names the size). Within Dynamo, its guards
    hold for every size the new code serves; the call that brought the size runs the plan it
    has. None where the graph cannot be compiled again so: not a training graph of a Dynamo
    frame, or no guard can be added."""
    from ..torch_api.dynamo import add_frame_guard

    frame = _frame_id()
    if frame is None:
        return None
    inputs: dict[str, list[tuple[str, int]]] = {}  # size symbol -> the (source, dim) sizes it is
    symints: dict[str, torch.SymInt] = {}
    for source, value in graph_input_sources(gm):
        if isinstance(value, torch.Tensor):
            for dim, size in enumerate(value.shape):
                symbol = _plain_symbol(size)
                if symbol is not None:
                    inputs.setdefault(symbol.name, []).append((source, dim))
                    symints[symbol.name] = size
    stale = [False]
    if not inputs or not add_frame_guard(lambda _frame_locals: not stale[0],
                                         "compile_offload: a dynamic size above the one planned for"):
        return None
    line = (frame, bucket_index() or 0)
    asked = _replans.get(line)
    replanned = asked.pop(0)[0] if asked else 0  # this graph's compiles again before it (FIFO: the order asked)

    def replan(sizes: dict[str, int], planned: dict[str, int],
               refused: Callable[[], None] = lambda: None) -> int | str:
        if replanned >= MAX_REPLANS:
            return f"this one was compiled again for larger sizes {MAX_REPLANS} times already"
        versions, limit = len(_frame_compiles.get(frame, ())), dynamo_config.recompile_limit
        if versions + 1 > limit:  # past it Dynamo would run the frame uncompiled: no budget at all
            return (f"its frame has {versions} compiled versions, and one more would pass "
                    f"torch._dynamo.config.recompile_limit ({limit}), past which Dynamo runs it uncompiled")
        named = [name for name in sizes if name in symints
                 and not _may_plan_at(symints[name], symints[name].node.expr, sizes[name])]
        if named or not any(name in inputs for name in sizes):
            return (f"hint_override names the size of {', '.join(named)} (or the size is outside the range "
                    "Dynamo allows it)" if named
                    else "its sizes cannot be traced to its inputs")
        # The sizes planned for, those that grew raised: a record that covers both.
        raised = {(source, dim): size for name, size in {**planned, **sizes}.items()
                  for source, dim in inputs.get(name, ())}
        _record(frame, raised)

        def undo() -> None:  # the compile for those sizes raised (strict_budget's BudgetError, say)
            stale[0] = False
            if raised in _records.get(frame, []):
                _records[frame].remove(raised)
            refused()

        _replans.setdefault(line, []).append((replanned + 1, undo))
        stale[0] = True
        return replanned + 1

    return replan


_frame_compiles: dict[int, set[int]] = {}  # frame -> its compiles that succeeded (the versions Dynamo holds, at most)


def note_compile() -> None:
    """Count the compile Dynamo made of its frame, once it succeeded (a compile that raised is
    no version Dynamo keeps); its first compile after ``torch._dynamo.reset()``, which numbers
    frames and their compiles from 0 again, counts from 1."""
    compiled = compile_id()
    if compiled is not None:  # (DDPOptimizer's bucket graphs are one compile: counted once)
        frame, count = compiled
        if count == 0:
            _frame_compiles[frame] = set()
        _frame_compiles.setdefault(frame, set()).add(count)


def replan_failed() -> None:
    """The compile Dynamo is making raised (``BudgetError`` under ``strict_budget``, or any
    error): where graphs of its frame that met larger sizes asked for it
    (``replan_when_larger``; under DDPOptimizer, any bucket's graph), each serves the frame
    again and the sizes it asked for are refused; else the next call would compile again, and
    fail again, whatever its sizes."""
    compiled = compile_id()
    for line, asked in _replans.items():
        if compiled is not None and line[0] == compiled[0] and asked:
            asked.pop(0)[1]()


def _frame_id() -> int | None:
    """The Dynamo frame being compiled; at its first compile in a new context (after
    ``torch._dynamo.reset()``, which numbers frames from 0 again), what was recorded under its
    number is forgotten."""
    compiled = compile_id()
    if compiled is None:
        return None
    frame = compiled[0]
    if frame_begun(_first_compile):
        _records.pop(frame, None)
        for line in [line for line in _replans if line[0] == frame]:
            del _replans[line]
    return frame


def _plain_symbol(size: Any):
    """The size symbol ``size`` is, or None (an int, an expression of symbols, or a nested
    tensor's ragged size, whose hint is no number)."""
    if not isinstance(size, torch.SymInt) or isinstance(getattr(size.node, "hint", None), torch.SymInt):
        return None
    expr = getattr(size.node, "expr", None)  # a nested int itself (NestedIntNode) has none
    return expr if getattr(expr, "is_Symbol", False) else None


def _may_plan_at(size: torch.SymInt, symbol: Any, value: int) -> bool:
    """Whether ``symbol`` may be planned at ``value``: no ``hint_override`` names its size,
    and ``value`` is within the range Dynamo allows it."""
    env = size.node.shape_env
    if symbol in (getattr(env, "var_to_hint_override", None) or {}):
        return False
    allowed = getattr(env, "var_to_range", {}).get(symbol)
    return allowed is None or bool(allowed.lower <= value <= allowed.upper)
