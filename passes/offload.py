"""Insert offload / reload / wait nodes into partitioned forward and backward graphs.

Works on the GraphModules torch's partitioner builds (``_extract_fwd_bwd_modules``):

* forward outputs: ``num_fwd_outputs`` user outputs, then the saved tensors, then saved
  opaque objects and symints;
* backward placeholders: saved symints, saved tensors, tangents, ... (the order differs
  between torch versions, so placeholders are matched by *name*: a backward placeholder
  has the name of the forward node it receives).

For each offloaded saved tensor ``x`` the pass builds::

    forward:   host = offload(x, contiguous_host)          right after x's producer
               ... x's remaining forward uses ...
               w    = wait_offload(host, x)                right after x's last forward use
               return (..., w, ...)                         w replaces x among the saved values
    backward:  x (placeholder, now the host tensor)
               dev  = reload(x, device, stride)            prefetch_distance nodes before ...
               ...
               x2   = wait_reload(dev, x)                  ... x's first backward use
               uses of x -> x2

The op overloads are injected through ``OffloadOps`` (``compile_offload.runtime.ops.OFFLOAD_OPS``):
this package never imports ``compile_offload``. The forward-side wait sits where ``x``
would be freed anyway (its last forward use), so offloading never extends ``x``'s device
lifetime; a scheduling pass may move the waits and reloads later, within the data edges.

Every inserted node carries ``node.meta["offload"] = {"role": ..., "tensor": <saved name>}``
so later passes can pair them, and ``meta["val"]`` computed by the ops' fake kernels. The
backward placeholder's ``meta["val"]`` becomes the host tensor's (CPU) fake value, which is
what the backward receives at run time.

Eligibility (``eligible_for_offload``), and why:

* a tensor (``meta["val"]``) with strided layout on a CPU or CUDA device, not a tensor
  subclass: the ops copy plain dense memory;
* not a graph input (primals, RNG seeds): the caller holds inputs, offloading frees nothing;
* not a constant of the graph (``get_attr``, a tensor made in the forward from literals):
  the compiled graph holds it for its lifetime, so offloading frees nothing;
* not a view or alias of a graph input (shares a placeholder's storage): same reason, and
  the input's storage would be read after the caller may have mutated it;
* not the output of a collective, nor a view of one (``passes.analyze.collective_source``):
  an all-gathered parameter or a reduced tensor stays where its sharding scheme put it,
  and a collective's buffer may still be written by the communication library until its
  ``wait_tensor``;
* not zero bytes: nothing to move;
* a layout the round trip restores exactly: non-overlapping and dense (copied as is), or
  non-overlapping with static sizes and strides (gathered to a contiguous host copy and
  scattered back); overlapping layouts (``expand``) are refused.

``eligible_saved_tensors`` adds one more rule for saved tensors: a saved tensor that is also
a forward user output (or aliases one) stays on the device anyway, so it is not offloaded.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from . import compat
from .analyze import collective_source

ROLE_OFFLOAD = "offload"
ROLE_WAIT_OFFLOAD = "wait_offload"
ROLE_RELOAD = "reload"
ROLE_WAIT_RELOAD = "wait_reload"


@dataclass(frozen=True)
class OffloadOps:
    """The op overloads the pass inserts (``compile_offload.runtime.ops.OFFLOAD_OPS``).

    Signatures: ``offload(src, contiguous_host: bool) -> host``,
    ``wait_offload(host, source) -> host``, ``reload(host, device, stride | None) -> dev``,
    ``wait_reload(dev, host) -> dev``.
    """

    offload: Any
    wait_offload: Any
    reload: Any
    wait_reload: Any


# --- private torch helpers (behind compat) -----------------------------------------------------

_is_dense = compat.is_non_overlapping_and_dense
_is_subclass = compat.is_traceable_wrapper_subclass
_detect_fake_mode = compat.detect_fake_mode


def _storage_key(val: torch.Tensor):
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(val.untyped_storage())


# --- eligibility -------------------------------------------------------------------------------


def _is_static(values) -> bool:
    return all(isinstance(v, int) for v in values)


def is_non_overlapping(size, stride) -> bool:
    """No two indices of a ``size``/``stride`` layout share a memory location (static ints).

    Sufficient test, exact for every layout slicing, transposing and narrowing produce: with
    the dimensions sorted by stride, each stride exceeds the largest offset the smaller ones
    reach. (``torch._debug_has_internal_overlap`` answers "too hard" for most of these.)
    """
    dims = sorted((st, sz) for sz, st in zip(size, stride) if sz > 1)
    reach = 0
    for st, sz in dims:
        if st <= reach:
            return False
        reach += (sz - 1) * st
    return True


def host_layout(val: torch.Tensor) -> tuple[bool, list[int] | None]:
    """``(contiguous_host, reload_stride)``: the offload and reload arguments for a saved
    tensor whose (fake) value is ``val``. Assumes ``eligible_for_offload`` said yes.

    ``contiguous_host``: dense tensors are copied as they are, others are gathered into a
    contiguous host copy. The decision is made here, from the graph's metadata, because
    the backward graph is built against the host tensor's layout; Inductor may hand the op
    a differently (still densely) strided source at run time.

    ``reload_stride``: the saved tensor's stride with static sizes, so the backward gets
    exactly the layout its graph was traced with whatever layout the host copy has; None
    with symbolic sizes (the reload then takes the host tensor's stride, which for the
    dense tensors eligible there is the source's).
    """
    stride = list(val.stride())
    static = _is_static(val.shape) and _is_static(stride)
    return not _is_dense(val), stride if static else None


def _layout_reason(val: torch.Tensor) -> str | None:
    if _is_dense(val):
        return None
    if not (_is_static(val.shape) and _is_static(val.stride())):
        return "non-dense layout with symbolic sizes or strides"
    if not is_non_overlapping(val.shape, val.stride()):
        return "overlapping layout (e.g. expand): a copy cannot restore it"
    return None


_PLACEHOLDER_STORAGES: "weakref.WeakKeyDictionary[fx.Graph, tuple[tuple, set]]" = weakref.WeakKeyDictionary()


def _placeholder_storages(graph: fx.Graph) -> set:
    """The storages of the graph's inputs, kept per graph while its placeholders stay the
    same: the planner asks once per saved tensor, and a deep model has hundreds of both."""
    placeholders = tuple(graph.find_nodes(op="placeholder"))
    values = tuple(node.meta.get("val") for node in placeholders)
    cached = _PLACEHOLDER_STORAGES.get(graph)
    if cached is not None and len(cached[0]) == len(values) and all(a is b for a, b in zip(cached[0], values)):
        return cached[1]
    storages = set()
    for val in values:
        if isinstance(val, torch.Tensor) and not _is_subclass(val):
            storages.add(_storage_key(val))
    _PLACEHOLDER_STORAGES[graph] = (values, storages)
    return storages


def eligible_for_offload(node: fx.Node) -> tuple[bool, str]:
    """Whether ``node``'s value may be offloaded, and the reason when not (see module doc)."""
    if node.op == "placeholder":
        return False, "graph input"
    if node.op == "get_attr":
        return False, "a constant of the graph (get_attr): it lives as long as the graph"
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return False, "not a tensor" if val is not None else "no tensor metadata (meta['val'])"
    if _is_subclass(val) or val.layout != torch.strided:
        return False, f"not a plain strided tensor ({type(val).__name__}, {val.layout})"
    if val.device.type not in ("cpu", "cuda"):
        return False, f"device type {val.device.type!r} not supported"
    source = collective_source(node)
    if source is not None:
        return False, f"output of the collective {source.target} (all-gathered or reduced tensors are not offloaded)"
    numel = val.numel()
    if isinstance(numel, int) and numel == 0:
        return False, "zero bytes"
    if _storage_key(val) in _placeholder_storages(node.graph):
        return False, "view or alias of a graph input"
    reason = _layout_reason(val)
    if reason is not None:
        return False, reason
    return True, "eligible"


# --- the forward / backward structure ----------------------------------------------------------


def _output_node(gm: fx.GraphModule) -> fx.Node:
    return gm.graph.find_nodes(op="output")[0]


def _fw_outputs(fw_gm: fx.GraphModule) -> list:
    return list(_output_node(fw_gm).args[0])


def saved_tensor_names(fw_gm: fx.GraphModule, num_fwd_outputs: int) -> list[str]:
    """Names of the saved tensors (forward outputs after the user outputs that are tensors)."""
    names = []
    for value in _fw_outputs(fw_gm)[num_fwd_outputs:]:
        if isinstance(value, fx.Node) and isinstance(value.meta.get("val"), torch.Tensor):
            names.append(value.name)
    return names


def _user_output_storages(fw_gm: fx.GraphModule, num_fwd_outputs: int) -> set:
    storages = set()
    for value in _fw_outputs(fw_gm)[:num_fwd_outputs]:
        val = value.meta.get("val") if isinstance(value, fx.Node) else None
        if isinstance(val, torch.Tensor) and not _is_subclass(val):
            storages.add(_storage_key(val))
    return storages


def saved_tensor_eligibility(fw_gm: fx.GraphModule, num_fwd_outputs: int) -> dict[str, tuple[bool, str]]:
    """``eligible_for_offload`` for every saved tensor, plus: not (an alias of) a user output."""
    nodes = {n.name: n for n in fw_gm.graph.nodes}
    user_storages = _user_output_storages(fw_gm, num_fwd_outputs)
    result = {}
    for name in saved_tensor_names(fw_gm, num_fwd_outputs):
        ok, reason = eligible_for_offload(nodes[name])
        if ok and _storage_key(nodes[name].meta["val"]) in user_storages:
            ok, reason = False, "also (an alias of) a forward user output: stays on the device anyway"
        result[name] = (ok, reason)
    return result


def eligible_saved_tensors(fw_gm: fx.GraphModule, num_fwd_outputs: int) -> list[str]:
    """The saved tensors ``insert_offloads`` accepts (``debug_force_offload`` offloads all)."""
    return [name for name, (ok, _) in saved_tensor_eligibility(fw_gm, num_fwd_outputs).items() if ok]


# --- insertion -----------------------------------------------------------------------------------


def _fake_value(target, args: tuple):
    """Run ``target``'s fake kernel on the args' fake values (None without metadata)."""
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in args]
    tensors = [v for v in vals if isinstance(v, torch.Tensor)]
    if len(tensors) != sum(isinstance(a, fx.Node) for a in args):
        return None
    mode = _detect_fake_mode(tensors)
    if mode is None:
        return None
    with mode:
        return target(*vals)


def _new_node(graph: fx.Graph, target, args: tuple, role: str, tensor: str) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta["offload"] = {"role": role, "tensor": tensor}
    val = _fake_value(target, args)
    if val is not None:
        node.meta["val"] = val
    return node


def _last_forward_use(node: fx.Node, exclude: set[fx.Node], order: dict[fx.Node, int]) -> fx.Node | None:
    """The last user of ``node`` in the forward, by ``order`` (the forward's nodes numbered
    before any copy was inserted: inserting copies keeps the order of the others, and a
    saved tensor's users are the forward's own nodes, its own copy excluded)."""
    users = [u for u in node.users if u.op != "output" and u not in exclude]
    if not users:
        return None
    if any(u not in order for u in users):  # a user inserted since: number the graph again
        order = {n: i for i, n in enumerate(node.graph.nodes)}
    return max(users, key=order.__getitem__)


def _offload_forward(fw_gm: fx.GraphModule, node: fx.Node, output_index: int, ops: OffloadOps,
                     order: dict[fx.Node, int]) -> None:
    graph = fw_gm.graph
    contiguous_host, _ = host_layout(node.meta["val"])
    with graph.inserting_after(node):
        host = _new_node(graph, ops.offload, (node, contiguous_host), ROLE_OFFLOAD, node.name)
    anchor = _last_forward_use(node, exclude={host}, order=order) or host
    with graph.inserting_after(anchor):
        wait = _new_node(graph, ops.wait_offload, (host, node), ROLE_WAIT_OFFLOAD, node.name)
    output = _output_node(fw_gm)
    outputs = list(output.args[0])
    outputs[output_index] = wait
    output.args = (type(output.args[0])(outputs),) + tuple(output.args[1:])


def _compute_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op not in ("placeholder", "output")]


def _offload_backward(
    bw_gm: fx.GraphModule, placeholder: fx.Node, fw_val: torch.Tensor, host_val, prefetch_distance: int,
    ops: OffloadOps, original_order: list[fx.Node], position: dict[fx.Node, int],
) -> None:
    """``position``: each node of ``original_order`` (the backward's compute nodes before any
    copy was inserted) -> its index there."""
    graph = bw_gm.graph
    if host_val is not None:
        placeholder.meta["val"] = host_val
    users = list(placeholder.users)
    if not users:
        return  # the backward never reads it: nothing to reload
    first_use = min(users, key=lambda u: position.get(u, len(original_order)))
    reload_index = max(0, position.get(first_use, len(original_order)) - prefetch_distance)
    reload_anchor = original_order[reload_index] if reload_index < len(original_order) else first_use
    _, stride = host_layout(fw_val)
    with graph.inserting_before(reload_anchor):
        reloaded = _new_node(graph, ops.reload, (placeholder, fw_val.device, stride), ROLE_RELOAD, placeholder.name)
    with graph.inserting_before(first_use):
        wait = _new_node(graph, ops.wait_reload, (reloaded, placeholder), ROLE_WAIT_RELOAD, placeholder.name)
    placeholder.replace_all_uses_with(wait, delete_user_cb=lambda user: user not in (reloaded, wait))


def _check_names(names: list[str], fw_nodes: dict[str, fx.Node], saved_index: dict[str, int],
                 bw_placeholders: dict[str, fx.Node], eligibility: dict[str, tuple[bool, str]]) -> None:
    for name in names:
        if name not in saved_index:
            raise ValueError(f"insert_offloads: {name!r} is not a saved tensor of the forward graph")
        if name not in bw_placeholders:
            raise ValueError(f"insert_offloads: the backward graph has no placeholder named {name!r}")
        ok, reason = eligibility[name]
        if not ok:
            raise ValueError(f"insert_offloads: {name!r} cannot be offloaded: {reason}")


def insert_offloads(
    fw_gm: fx.GraphModule,
    bw_gm: fx.GraphModule,
    names: Iterable[str],
    ops: OffloadOps,
    *,
    num_fwd_outputs: int,
    prefetch_distance: int = 1,
    recompile: bool = True,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Offload the saved tensors ``names`` (forward node names); returns the rewritten graphs.

    ``prefetch_distance``: the reload goes that many backward nodes ahead of the tensor's
    first backward use (0: right before its wait). Raises ``ValueError`` for a name that is
    not an eligible saved tensor (filter with ``eligible_saved_tensors``). Modifies the
    graphs in place, lints and recompiles them (``recompile=False``: a caller that edits
    the graphs again and recompiles after; generating a deep graph's code takes a while).
    """
    if prefetch_distance < 0:
        raise ValueError(f"insert_offloads: prefetch_distance must be >= 0, got {prefetch_distance}")
    names = list(dict.fromkeys(names))
    fw_nodes = {n.name: n for n in fw_gm.graph.nodes}
    outputs = _fw_outputs(fw_gm)
    saved_index = {
        v.name: i for i, v in enumerate(outputs) if i >= num_fwd_outputs and isinstance(v, fx.Node)
    }
    bw_placeholders = {n.name: n for n in bw_gm.graph.find_nodes(op="placeholder")}
    _check_names(names, fw_nodes, saved_index, bw_placeholders, saved_tensor_eligibility(fw_gm, num_fwd_outputs))

    original_bw_order = _compute_nodes(bw_gm.graph)
    # Numbered once, not per tensor: a deep plan offloads hundreds of tensors.
    bw_position = {n: i for i, n in enumerate(original_bw_order)}
    fw_order = {n: i for i, n in enumerate(fw_gm.graph.nodes)}
    for name in names:
        node = fw_nodes[name]
        fw_val = node.meta["val"]
        _offload_forward(fw_gm, node, saved_index[name], ops, fw_order)
        host_val = _output_node(fw_gm).args[0][saved_index[name]].meta.get("val")
        _offload_backward(bw_gm, bw_placeholders[name], fw_val, host_val, prefetch_distance, ops, original_bw_order,
                          bw_position)

    for gm in (fw_gm, bw_gm):
        gm.graph.lint()
        if recompile:
            gm.recompile()
    return fw_gm, bw_gm
