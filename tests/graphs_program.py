"""The memory program of partitioned forward and backward graphs, as written (tests only).

``graphs_program`` simulates what the partitioned graphs actually do, so the tests can hold
the planner's own program (``passes.memory.plan_program``, what the solver evaluates)
against it: the same peak for every plan (``tests/test_fuzz.py``'s ``check_partition``, the
memory and schedule tests). Only tests use it, so it lives with them.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch.fx as fx

from compile_offload.passes.analyze import (allocated_bytes, fusable_nodes, is_convolution, layout_copies,
                                            storage_roots, tensor_value)
from compile_offload.passes.inductor.kernel_local import is_generated_kernel
from compile_offload.passes.inductor.loop_ranges import cpu_graph
from compile_offload.passes.inductor.node_kinds import loads_inputs_in_loop
from compile_offload.passes.memory import (Program, Step, _all_input_nodes, _backward_fusion, _is_host_copy,
                                           _kernel_local, _reads, _tuple_op, cpp_call_ends, in_cpp_call,
                                           in_place_candidates)


def _is_forward_key(key: Hashable) -> bool:
    """A partitioned backward's read of the forward's storage (``graphs_program``'s keys):
    a saved tensor."""
    return isinstance(key, tuple) and key[0] in ("fw", "fw-channels-last")


def graphs_program(fw_gm: fx.GraphModule, bw_gm: fx.GraphModule, num_fwd_outputs: int, fusion: bool = False) -> Program:
    """The program of partitioned forward and backward graphs, executed as written.

    Forward placeholders are steady state. The forward's saved outputs become the
    backward's leading placeholders (same storages); tangents are allocated when the
    backward starts; user outputs and gradients outlive the step.
    """
    steps: list[Step] = []
    kinds: list[bool | None] = []  # ``in_cpp_call`` of each step
    fw_generated = frozenset(n for n in fw_gm.graph.nodes if n.op == "call_function" and is_generated_kernel(n))
    bw_generated = frozenset(n for n in bw_gm.graph.nodes if n.op == "call_function" and is_generated_kernel(n))
    fw_roots = storage_roots(fw_gm.graph)
    fw_placeholders = {n for n in fw_gm.graph.nodes if n.op == "placeholder"}
    fw_output = next(n for n in reversed(fw_gm.graph.nodes) if n.op == "output")
    fw_results = list(fw_output.args[0])
    user_outputs, saved_outputs = fw_results[:num_fwd_outputs], fw_results[num_fwd_outputs:]

    def fw_key(node: fx.Node) -> Hashable:
        return ("fw", fw_roots.get(node, node).name)

    fw_fusable = fusable_nodes(fw_gm.graph.nodes) if fusion else frozenset()  # nothing kept: fused_nodes(nodes, set())
    fw_fused = set(fw_fusable | _kernel_local(fw_gm.graph, fw_fusable)) if fusion else set()
    copies = layout_copies(fw_gm.graph.nodes, fw_placeholders) if fusion else {}
    if copies:  # Inductor's channels-last copies of inputs its convolutions read
        steps.append(Step("channels-last copies", [(("fw-channels-last", n.name), b) for n, b in copies.items()]))
        kinds.append(False)
    key_bytes: dict[Hashable, int] = {}  # storage key -> bytes, for in-place reuse

    def fw_skip(x: fx.Node) -> bool:
        return fw_roots.get(x, x) in fw_placeholders

    for node in fw_gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        nbytes = 0 if node in fw_fused or _is_host_copy(node) else allocated_bytes(node, fw_roots)
        reads = _reads(node, fw_key, fw_fused, fw_skip)
        if (op := _tuple_op(node)) is not None:  # its outputs appear while its inputs live (StepBuilder._step)
            reads += _reads(op, fw_key, fw_fused, fw_skip)
        if nbytes:
            key_bytes[fw_key(node)] = nbytes
        if copies and is_convolution(node):
            reads += [("fw-channels-last", arg.name) for arg in node.all_input_nodes if arg in copies]
        steps.append(Step(node.name, [(fw_key(node), nbytes)] if nbytes else [], reads,
                          scattered=bool(nbytes) and loads_inputs_in_loop(node)))
        kinds.append(in_cpp_call(node, steps[-1], fw_generated))
    backward_start = len(steps)
    bw_fused, bw_roots = _backward_fusion(bw_gm.graph) if fusion else (set(), storage_roots(bw_gm.graph))
    bw_placeholders = [n for n in bw_gm.graph.nodes if n.op == "placeholder"]
    # A backward placeholder has the name of the forward node it receives (an offloaded
    # tensor keeps its name: the forward returns the wait in its place).
    saved_by_name = {}
    for output in saved_outputs:
        if isinstance(output, fx.Node) and tensor_value(output) is not None:
            offload = output.meta.get("offload")
            saved_by_name[offload["tensor"] if offload else output.name] = output
    key_of_placeholder: dict[fx.Node, Hashable | None] = {}
    copied_placeholders: dict[fx.Node, Hashable] = {}
    tangent_allocs = []
    for placeholder in bw_placeholders:
        if "tangents" in placeholder.name:
            val = tensor_value(placeholder)
            key = ("bw", placeholder.name)
            key_of_placeholder[placeholder] = key
            if val is not None:
                tangent_allocs.append((key, allocated_bytes(placeholder, bw_roots)))
        elif placeholder.name in saved_by_name:
            source = saved_by_name[placeholder.name]
            base = fw_roots.get(source, source)
            on_device = base not in fw_placeholders and not _is_host_copy(base)
            key_of_placeholder[placeholder] = fw_key(source) if on_device else None
            if base in copies:  # the backward receives the copy
                copied_placeholders[placeholder] = ("fw-channels-last", base.name)
        else:
            key_of_placeholder[placeholder] = None  # saved symints
    steps.append(Step("tangents", tangent_allocs, []))
    kinds.append(False)

    def bw_key(node: fx.Node) -> Hashable | None:
        base = bw_roots.get(node, node)
        if base.op == "placeholder":
            return key_of_placeholder.get(base)
        return ("bw", base.name)

    bw_memo: dict = {}
    key_bytes.update((key, nbytes) for key, nbytes in tangent_allocs)

    def bw_skip(x: fx.Node) -> bool:
        return bw_key(x) is None

    for node in bw_gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        nbytes = 0 if node in bw_fused else allocated_bytes(node, bw_roots)
        reads = list(_reads(node, bw_key, bw_fused, bw_skip))
        if (op := _tuple_op(node)) is not None:
            reads += _reads(op, bw_key, bw_fused, bw_skip)
        if copied_placeholders and is_convolution(node):
            reads += [copied_placeholders[arg] for arg in node.all_input_nodes if arg in copied_placeholders]
        in_place = in_place_candidates(node, nbytes, bw_key, bw_fused, bw_skip, _all_input_nodes, bw_memo,
                                       lambda x: key_bytes.get(bw_key(x), 0), _is_forward_key) if nbytes and fusion else ()
        if nbytes:
            key_bytes[bw_key(node)] = nbytes
        steps.append(Step(node.name, [(bw_key(node), nbytes)] if nbytes else [], reads, in_place=in_place,
                          scattered=bool(nbytes) and loads_inputs_in_loop(node)))
        kinds.append(in_cpp_call(node, steps[-1], bw_generated))
    bw_output = next(n for n in reversed(bw_gm.graph.nodes) if n.op == "output")
    outlives = {fw_key(o) for o in user_outputs if isinstance(o, fx.Node)}
    outlives |= {k for o in bw_output.args[0] if isinstance(o, fx.Node) for k in [bw_key(o)] if k is not None}
    calls = cpp_call_ends(kinds, backward_start) if fusion and cpu_graph(fw_gm.graph.nodes) else None
    return Program(steps, backward_start, outlives, call_end=calls)
