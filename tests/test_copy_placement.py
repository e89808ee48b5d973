"""The copies run where the plan put them: Inductor's generated code keeps the placement.

The plan issues each offload right after its producer, waits for it where the transfer
model says it has finished, and issues each reload ahead of its first backward use
(``passes/schedule.py``). Inductor's scheduler would move them (``reorder_for_peak_memory``
pulls each wait up to its offload and sinks each reload onto its wait); the backend turns
its reordering passes off for graphs with copies (``compile_offload/inductor/copy_order.py``).

These tests read the Python Inductor generates on a CPU for the forward and the backward
of a 6-block MLP with ``debug_force_offload=True`` and the ``h100`` profile (so the copies
are placed by the H100 transfer model, as a GPU run places them), and compare it with the
FX graphs Inductor was given (recorded by a post-grad pass, after every graph pass).
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.utils import run_and_get_code

import compile_offload
from compile_offload.inductor import copy_order
from compile_offload.passes.offload import ROLE_OFFLOAD, ROLE_RELOAD, ROLE_WAIT_OFFLOAD, ROLE_WAIT_RELOAD

from .partition_results import partitions

COPY_OPS = (ROLE_OFFLOAD, ROLE_WAIT_OFFLOAD, ROLE_RELOAD, ROLE_WAIT_RELOAD)
_CALL = re.compile(r"^(?:(\w+) = )?(extern_kernels\.\w+|cpp_fused_\w+|torch\.ops\.compile_offload\.(\w+)\.default|"
                   r"torch\.ops\.aten\.\w+\.\w+)\((.*)\)$")


class _RecordGraphs(CustomGraphPass):
    """Post-grad pass that keeps, per graph Inductor lowers, its nodes' kinds in order."""

    def __init__(self) -> None:
        self.graphs: list[list[tuple]] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.graphs.append([_fx_step(node) for node in graph.nodes if node.op == "call_function"])

    def uuid(self):
        return get_hash_for_files((__file__,))


def _fx_step(node: torch.fx.Node) -> tuple[str, str, tuple]:
    """(kind, what) of one FX node: kind is a copy role, "extern" (a matmul, which Inductor
    runs as its own kernel in graph order), "view" (no kernel) or "compute"; what names the
    copied saved tensor for copies."""
    target = node.target
    if getattr(target, "namespace", None) == "compile_offload":
        role = target._opname
        # The copied tensor: a copy's first argument, a wait's second (the offload's source,
        # the reload's host tensor), as in the generated code.
        tensor = node.args[1] if role in (ROLE_WAIT_OFFLOAD, ROLE_WAIT_RELOAD) else node.args[0]
        return role, tensor.name, ()
    if target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
        return "extern", target._opname, ()
    if getattr(target, "is_view", False) or target in (torch.ops.aten.t.default,):
        return "view", str(target), ()
    return "compute", str(target), ()


def _code_steps(code: str) -> list[tuple[str, str, list[str]]]:
    """The calls of ``call()`` in Inductor's code, in order: (kind, name, argument words).
    kind: a copy role, "extern" (extern_kernels.mm/addmm/bmm), "compute" (any other kernel)."""
    body = code[code.index("def call("):]
    steps = []
    for line in body.splitlines():
        match = _CALL.match(line.strip())
        if match is None:
            continue
        _, callee, copy_role, args = match.groups()
        words = re.findall(r"\w+", args)
        if copy_role is not None:
            steps.append((copy_role, callee, words))
        elif callee.startswith("extern_kernels.") and callee.split(".")[1] in ("mm", "addmm", "bmm"):
            steps.append(("extern", callee.split(".")[1], words))
        else:
            steps.append(("compute", callee, words))
    return steps


def _mlp() -> nn.Sequential:
    return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(64, 64), nn.GELU())])


def _compile_and_read(reorder_passes=None, planned=None):
    """Forward and backward code and the FX graphs Inductor lowered, for one training step;
    ``planned`` (a list) receives the steps of the graphs the partitioner returned."""
    model, x = _mlp(), torch.randn(32, 64)
    recorder = _RecordGraphs()
    backend = compile_offload.offload_remat(debug_force_offload=True, device_profile="h100")

    def step():
        compiled = torch.compile(model, backend=backend)
        compiled(x).sum().backward()

    with torch._inductor.config.patch(fx_graph_cache=False, post_grad_custom_post_pass=recorder), \
            torch._functorch.config.patch(enable_autograd_cache=False), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the h100 profile on a CPU warns (reliability.md)
        with pytest.MonkeyPatch.context() as patch, partitions() as found:
            if reorder_passes is not None:
                patch.setattr(copy_order, "_REORDERING_PASSES", reorder_passes)
            _, codes = run_and_get_code(step)
    if planned is not None:
        planned.extend([_fx_step(n) for n in gm.graph.nodes if n.op == "call_function"]
                       for p in found for gm in (p.fw, p.bw))
    assert len(codes) == 2 and len(recorder.graphs) == 2, (len(codes), len(recorder.graphs))
    return codes, recorder.graphs


def _skeleton(steps) -> list[tuple[str, str]]:
    """The copies and matmuls in order: what Inductor must not reorder."""
    return [(kind, what) for kind, what, *_ in steps if kind in COPY_OPS or kind == "extern"]


def _code_skeleton(steps) -> list[str]:
    return [kind for kind, *_ in steps if kind in COPY_OPS or kind == "extern"]


def _kernels_between(steps, start: int, end: int) -> int:
    return sum(1 for kind, *_ in steps[start + 1:end] if kind in ("extern", "compute"))


def _copy_spans(steps, tensor_of) -> dict[tuple[str, int], tuple[int, int]]:
    """(copy role, k) -> (index of the k-th copy of that role in issue order, index of its
    wait). Copies are paired with their waits by the tensor they move (``tensor_of``)."""
    waits_for = {ROLE_WAIT_OFFLOAD: ROLE_OFFLOAD, ROLE_WAIT_RELOAD: ROLE_RELOAD}
    issued, spans = {}, {ROLE_OFFLOAD: [], ROLE_RELOAD: []}
    for index, step in enumerate(steps):
        kind = step[0]
        if kind in spans:
            issued[(kind, tensor_of(step))] = index
        elif kind in waits_for and (waits_for[kind], tensor_of(step)) in issued:
            spans[waits_for[kind]].append((issued.pop((waits_for[kind], tensor_of(step))), index))
    return {(role, k): span for role, role_spans in spans.items() for k, span in enumerate(sorted(role_spans))}


def _fx_tensor(step) -> str:
    return step[1]


def _code_tensor(step) -> str:
    """What pairs a copy with its wait in generated code: an offload's source buffer (its
    wait's second argument), a reload's host tensor (its wait's second argument)."""
    kind, _, words = step
    return words[0] if kind in (ROLE_OFFLOAD, ROLE_RELOAD) else words[1]


def _placement_problems(codes, graphs) -> list[str]:
    problems = []
    for code, graph, side in zip(codes, graphs, ("forward", "backward")):
        steps = _code_steps(code)
        # 1. The copies, their waits and the matmuls run in the order of the graph the plan built.
        if _code_skeleton(steps) != [kind for kind, _ in _skeleton(graph)]:
            problems.append(f"{side}: copies moved relative to the matmuls:\n  graph {_skeleton(graph)}\n"
                            f"  code  {_code_skeleton(steps)}")
        # 2. A copy the plan put compute under has a kernel between it and its wait.
        fx_spans, code_spans = _copy_spans(graph, _fx_tensor), _copy_spans(steps, _code_tensor)
        if len(fx_spans) != len(code_spans):
            problems.append(f"{side}: {len(fx_spans)} copies with waits in the graph, {len(code_spans)} in the code")
        for key, fx_span in fx_spans.items():
            if _kernels_between(graph, *fx_span) == 0:
                continue  # planned without compute under it (a reload at the backward's start)
            code_span = code_spans.get(key)
            if code_span is None or _kernels_between(steps, *code_span) == 0:
                problems.append(f"{side}: {key[0]} #{key[1]} has no kernel between it and its wait")
        # 3. Each offload is issued right after the kernel that produced its source.
        for index, (kind, _, words) in enumerate(steps):
            if kind != ROLE_OFFLOAD:
                continue
            previous = next((s for s in reversed(steps[:index]) if s[0] in ("extern", "compute")), None)
            if previous is None or words[0] not in previous[2]:
                problems.append(f"{side}: offload of {words[0]} is not issued right after its producer ({previous})")
    return problems


@pytest.mark.inductor
@pytest.mark.slow
def test_inductor_runs_the_copies_where_the_plan_put_them():
    planned: list = []
    codes, graphs = _compile_and_read(planned=planned)
    # Inductor's graph passes keep the partitioner's placement ...
    assert [_skeleton(g) for g in graphs] == [_skeleton(g) for g in planned]
    # ... and so does its scheduler.
    assert _placement_problems(codes, graphs) == []
    # What the plan put there, so the checks above compare something: on the h100 model
    # the forward's waits and the backward's prefetches cover compute.
    for graph in graphs:
        spans = _copy_spans(graph, _fx_tensor)
        assert spans and sum(_kernels_between(graph, *span) > 0 for span in spans.values()) >= len(spans) // 2


@pytest.mark.inductor
@pytest.mark.slow
def test_the_placement_check_catches_inductors_reordering():
    """With Inductor's reordering passes left on, the same check fails (so it can)."""
    codes, graphs = _compile_and_read(reorder_passes={})
    assert _placement_problems(codes, graphs)


def test_graphs_with_copies_are_compiled_without_reordering_passes():
    patches = copy_order.order_keeping_patches()
    assert patches.get("reorder_for_peak_memory") is False  # present on torch 2.11 to 2.14
    seen = []

    def inner(gm, *args, **kwargs):
        seen.append(torch._inductor.config.reorder_for_peak_memory)

    graph = torch.fx.symbolic_trace(lambda x: x + 1)
    compile_with_order = copy_order.keeping_copy_order(inner)
    compile_with_order(graph)
    assert not copy_order.has_copy_ops(graph)
    graph.graph.call_function(torch.ops.compile_offload.offload.default, (next(iter(graph.graph.nodes)), False))
    assert copy_order.has_copy_ops(graph)
    compile_with_order(graph)
    assert seen == [torch._inductor.config.reorder_for_peak_memory, False]
