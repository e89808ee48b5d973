"""Selective activation checkpointing policies as constraints and preferences of the plan.

``torch.utils.checkpoint.create_selective_checkpoint_contexts`` tags every node its
region traces with ``meta["recompute"]`` (a ``CheckpointPolicy``) and ``meta["ac_graph_id"]``;
a plain ``checkpoint`` region tags ``PREFER_RECOMPUTE``. The solver is not told about
policies: they reach it through the inputs it already has.

* ``MUST_SAVE``: never recomputed (``JointAnalysis.ban``), so the starting saved set keeps
  it (``passes.solve.recompute.without_banned_recompute``), and never offloaded (the offload
  eligibility predicate).
* ``MUST_RECOMPUTE`` and ``PREFER_RECOMPUTE``: torch's min-cut, our starting plan, never
  saves them, and the solver only recomputes more. A move may still save one as the input
  of another recomputation (it stops walking back at a matmul, or after ``MAX_EXTENSION``
  nodes): the decision's reason says so, and for ``MUST_RECOMPUTE`` one warning names it.
* ``MUST_CPU_OFFLOAD``: never recomputed (a ban), saved as its own storage rather than a
  view of it (``saved_offload_roots``), and offloaded after solving when the chosen plan
  keeps it (``offload_tagged``); one that cannot be offloaded (a view, a user output,
  offload disabled, the ``cpu`` profile) stays on the device with a warning naming it.
* ``PREFER_SAVE``: a cost bias: recomputing it looks ``PREFERENCE_BIAS`` times dearer to the
  solver, so a budget recomputes it last. Since the greedy solver's candidates depend on
  the costs, the graph is solved with and without the bias and the biased plan is kept
  only when it fits and recomputes fewer preferred tensors (``follow_preferences``).
  Predicted times are always unbiased.
* ``PREFER_CPU_OFFLOAD``: offloaded after solving when the chosen plan keeps it and it can
  be; left as planned otherwise (a preference).

Tags are read before ``passes.compat.prepare_joint``, which tags the boundaries of
consecutive regions ``MUST_SAVE`` itself (torch's rule, not the user's), and found again by
node name in the prepared graph (its CSE copies nodes under their names).
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .analyze import MUST_SAVE_REASON, JointAnalysis
from .saved_storages import views_by_base

MUST_SAVE, PREFER_SAVE = "MUST_SAVE", "PREFER_SAVE"
MUST_RECOMPUTE, PREFER_RECOMPUTE = "MUST_RECOMPUTE", "PREFER_RECOMPUTE"
MUST_CPU_OFFLOAD, PREFER_CPU_OFFLOAD = "MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD"
# The decision each policy asks for (Plan decision kinds).
WANTS = {MUST_SAVE: "keep", PREFER_SAVE: "keep", MUST_RECOMPUTE: "recompute", PREFER_RECOMPUTE: "recompute",
         MUST_CPU_OFFLOAD: "offload", PREFER_CPU_OFFLOAD: "offload"}
# How much dearer recomputing a PREFER_SAVE tensor looks to the solver: enough to reorder
# tensors of similar worth. It cannot cost a fitting plan: the graph is also solved without
# it, and that plan wins unless the biased one fits and recomputes fewer preferred tensors.
PREFERENCE_BIAS = 2.0


@dataclass(frozen=True)
class UserPolicy:
    """The tagged forward nodes of one joint graph, by what their policy asks."""

    must_keep: frozenset[fx.Node] = frozenset()
    must_recompute: frozenset[fx.Node] = frozenset()
    must_offload: frozenset[fx.Node] = frozenset()
    prefer_offload: frozenset[fx.Node] = frozenset()
    # Factor on each PREFER_SAVE node's recompute seconds, as the solver sees them.
    bias: dict[fx.Node, float] = field(default_factory=dict)
    policy_of: dict[fx.Node, str] = field(default_factory=dict)  # every tagged node -> its policy's name

    def __bool__(self) -> bool:
        return bool(self.policy_of)

    def biased(self, seconds: Callable[[fx.Node], float]) -> Callable[[fx.Node], float]:
        """``seconds`` as the solver should see it (unchanged without preferences)."""
        if not self.bias:
            return seconds
        bias = self.bias

        def biased_seconds(node: fx.Node) -> float:
            return seconds(node) * bias.get(node, 1.0)

        return biased_seconds

    def may_offload(self, node: fx.Node) -> bool:
        """``MUST_SAVE`` keeps a tensor on the device, ``MUST_RECOMPUTE`` saves nothing."""
        return node not in self.must_keep and node not in self.must_recompute

    def policy(self, tensor: fx.Node) -> str | None:
        """The policy of a saved tensor: its own tag, else its multi-output producer's."""
        found = self.policy_of.get(tensor)
        if found is None and tensor.target is operator.getitem and isinstance(tensor.args[0], fx.Node):
            found = self.policy_of.get(tensor.args[0])
        return found


def saved_offload_roots(a: JointAnalysis, policy: UserPolicy, saved: list[fx.Node]) -> list[fx.Node]:
    """``saved`` with the saved views of a ``*_CPU_OFFLOAD`` tensor replaced by the tensor
    itself (the views are recomputed from it in the backward, for free): only a storage's
    owner can be offloaded, and torch's min-cut often saves the view a matmul reads (a
    ``view`` of an activation) instead of the activation."""
    wanted = policy.must_offload | policy.prefer_offload
    if not wanted:
        return saved
    result: dict[fx.Node, None] = {}
    for tensor in saved:
        root = a.roots.get(tensor, tensor)
        result[root if root in wanted and root is not tensor else tensor] = None
    return list(result)


def read_tags(gm: fx.GraphModule) -> dict[str, str]:
    """Node name -> policy name of every node a checkpoint region tagged (``ac_graph_id``
    marks the region's nodes; torch's own ``MUST_SAVE`` marks of mutations and collectives
    outside regions carry none). Read before ``prepare_joint`` retags region boundaries."""
    tags = {}
    for node in gm.graph.nodes:
        policy = node.meta.get("recompute")
        if policy is not None and "ac_graph_id" in node.meta and hasattr(policy, "name"):
            tags[node.name] = policy.name
    return tags


def apply_policy(a: JointAnalysis, tags: dict[str, str]) -> UserPolicy:
    """The policy of the analysed graph from ``read_tags``'s tags, with ``MUST_SAVE`` and
    ``MUST_CPU_OFFLOAD`` nodes banned from recomputation (reason: the policy)."""
    if not tags:
        return UserPolicy()
    policy_of = {node: tags[node.name] for node in a.fw_nodes if node.name in tags}
    by_policy: dict[str, set[fx.Node]] = {}
    for node, name in policy_of.items():
        by_policy.setdefault(name, set()).add(node)
    for node in by_policy.get(MUST_SAVE, set()) | by_policy.get(MUST_CPU_OFFLOAD, set()):
        if node.op == "call_function" and (node not in a.ban or a.ban[node] == MUST_SAVE_REASON):
            a.ban[node] = f"user policy {policy_of[node]}"
    bias = {node: PREFERENCE_BIAS for node in by_policy.get(PREFER_SAVE, ())}
    return UserPolicy(
        must_keep=frozenset(by_policy.get(MUST_SAVE, ())),
        must_recompute=frozenset(by_policy.get(MUST_RECOMPUTE, ())),
        must_offload=frozenset(by_policy.get(MUST_CPU_OFFLOAD, ())),
        prefer_offload=frozenset(by_policy.get(PREFER_CPU_OFFLOAD, ())),
        bias=bias,
        policy_of=policy_of,
    )


def why_not_offloadable(a: JointAnalysis, tensor: fx.Node, saved,
                        eligible: Callable[[fx.Node], tuple[bool, str]]) -> str | None:
    """Why a saved ``tensor`` cannot be offloaded (the rules of
    ``passes.solve.joint.offloadable``, each named), or None if it can."""
    root = a.roots.get(tensor, tensor)
    if root is not tensor:
        return f"it is a view of {root.name} (only a storage's owner is offloaded)"
    if root in a.steady or root.op != "call_function":
        return "it is a graph input"
    if root in {a.roots.get(o, o) for o in a.fw_outputs}:
        return "it is (a view of) a user output, which stays on the device anyway"
    if sum(1 for s in saved if a.roots.get(s, s) is root) > 1:
        return "views of its storage are saved too, and would keep reading the device copy"
    if a.bytes_of.get(root, 0) <= 0:
        return "it allocates no bytes"
    ok, reason = eligible(root)
    return None if ok else reason


def offload_tagged(a: JointAnalysis, policy: UserPolicy, solution, seconds, offload, why_no_offload: str | None,
                   base_saved, graph_name: str):
    """The solution with every kept ``*_CPU_OFFLOAD`` tensor offloaded, simulated again.

    ``seconds``: the solver's cost function; ``offload``: its ``OffloadOptions`` (None when offload is off, and
    ``why_no_offload`` says why). A ``MUST_CPU_OFFLOAD`` tensor that cannot be offloaded is
    named in one warning (not a view of a graph input: it holds no activation memory); a
    ``PREFER_CPU_OFFLOAD`` one is left as planned."""
    from .offload import eligible_for_offload
    from .solve.recompute import unread_saved

    chosen = solution.chosen
    unread = unread_saved(a, chosen.saved)  # the forward does not save them: nothing to offload
    wanted = sorted((t for t in chosen.saved if t not in chosen.offloaded and t not in unread
                     and policy.policy(t) in (MUST_CPU_OFFLOAD, PREFER_CPU_OFFLOAD)), key=a.position.__getitem__)
    if not wanted:
        return solution
    refused: dict[fx.Node, str] = {}
    extra = set()
    for tensor in wanted:
        reason = why_no_offload if offload is None else why_not_offloadable(a, tensor, chosen.saved,
                                                                            eligible_for_offload)
        if reason is None:
            extra.add(tensor)
        elif policy.policy(tensor) == MUST_CPU_OFFLOAD and a.roots.get(tensor, tensor) not in a.steady:
            # (a view of a parameter or input, a weight's transpose, holds no activation memory)
            refused[tensor] = reason
    if refused:
        warnings.warn(
            f"compile_offload: {graph_name}: user policy MUST_CPU_OFFLOAD not applied to "
            + "; ".join(f"{t.name} ({reason})" for t, reason in refused.items())
            + ": kept on the device instead",
            stacklevel=3,
        )
    if not extra:
        return solution
    return _resimulate(a, solution, chosen.offloaded | frozenset(extra), seconds, offload, base_saved)


def _resimulate(a: JointAnalysis, solution, offloaded, seconds, offload, base_saved):
    """``solution`` with its chosen plan offloading ``offloaded``, simulated again under the
    unbiased ``seconds`` (copies placed as a cached plan's would be)."""
    from .solve.recompute import Prefix, offload_reasons
    from .solve.joint import Evaluator

    chosen = solution.chosen
    evaluate = Evaluator(a, seconds, offload, base_saved)
    solution.chosen = evaluate(Prefix(chosen.saved, frozenset(offloaded), chosen.moves), keep_timeline=True)
    solution.offloaded = offload_reasons(solution.chosen.transfers)
    if solution.budget_bytes is not None:
        solution.feasible = solution.chosen.peak_bytes <= solution.budget_bytes
    return solution


def unmet_preferences(policy: UserPolicy, solution) -> int:
    """How many ``PREFER_SAVE`` tensors ``solution`` recomputes or offloads."""
    moved = set(solution.recomputed) | set(solution.chosen.offloaded)
    return sum(1 for tensor in moved if policy.policy(tensor) == PREFER_SAVE)


def follow_preferences(a: JointAnalysis, policy: UserPolicy, plain, preferring, seconds, offload, base_saved):
    """The solution to keep: ``preferring`` (solved with the ``PREFER_SAVE`` bias) when it
    fits the budget and recomputes fewer preferred tensors, else ``plain`` (solved without).

    The solver builds its candidate plans greedily, so a bias changes which plans it looks
    at, not only which it picks; comparing both results keeps a preference from costing a
    plan that fits (or the lower minimum peak). Ties go to the faster plan (unbiased)."""
    from .solve.recompute import step_seconds

    if preferring is None:
        return plain

    def rank(solution):
        transfers = solution.chosen.transfers
        time = step_seconds(a, solution.chosen.saved, seconds) + (transfers.added_seconds if transfers else 0.0)
        if not solution.feasible:
            return (1, solution.chosen.peak_bytes, unmet_preferences(policy, solution), time)
        return (0, 0, unmet_preferences(policy, solution), time)

    if rank(preferring) >= rank(plain):
        return plain
    if preferring.chosen.offloaded:  # its copies were placed under the biased seconds
        return _resimulate(a, preferring, preferring.chosen.offloaded, seconds, offload, base_saved)
    return preferring


def _saved_by_torch(tensor: fx.Node) -> bool:
    """torch's ``cleanup_recompute_tags`` retagged it ``MUST_SAVE``: the output of one
    checkpoint region read by the next one (or with a backward hook)."""
    tag = tensor.meta.get("recompute")
    return getattr(tag, "name", None) == MUST_SAVE


def _inductor_seeds(tensor: fx.Node) -> bool:
    """Inductor's own seed draw (``prims.inductor_seeds``), which its random-op replacement puts
    in place of the user's random ops; torch 2.14 copies their checkpoint tag onto it. Saving
    it is how those ops are recomputed, so it is not a tag left unapplied."""
    seeds = getattr(torch.ops.prims, "inductor_seeds", None)
    return seeds is not None and tensor.target in (seeds, getattr(seeds, "default", None))


def annotate(plan, policy: UserPolicy, a: JointAnalysis, graph_name: str) -> None:
    """Say "user policy" in the reason of each decision a policy made, say where a
    preference was overridden, and warn once about ``MUST_RECOMPUTE`` tensors the plan
    still saves."""
    if not policy:
        return
    by_name = {node.name: node for node in a.fw_nodes}
    saved_views = views_by_base(a, [by_name[name] for name in plan.saved if name in by_name])
    unmet = []
    for decision in plan.decisions:
        tensor = by_name.get(decision.name)
        name = policy.policy(tensor) if tensor is not None else None
        on_views = ""
        if tensor is not None and (name is None or (name.startswith("PREFER") and WANTS[name] != decision.decision)):
            # a storage saved for the tagged views the plan saves (a MUST_SAVE split): their tag
            # was applied (a preference of its own gives way; a MUST_* of its own is its own)
            tagged = [view for view in saved_views.get(tensor, ())
                      if WANTS.get(policy.policy(view)) == decision.decision]
            if tagged:
                name = policy.policy(tagged[0])
                on_views = f" (on its views {', '.join(view.name for view in tagged)})"
        if name is None:
            continue
        if WANTS[name] == "recompute" and decision.decision == "keep" and _saved_by_torch(tensor):
            decision.reason = f"read by the next checkpoint region: saved by torch's rule ({name} tag not applied)"
        elif WANTS[name] == decision.decision:
            decision.reason = (f"user policy {name}{on_views}"
                               + ("" if decision.decision == "keep" else f"; {decision.reason}"))
        elif name.startswith("PREFER"):
            decision.reason += f" (overrides the user policy {name})"
        elif name == MUST_RECOMPUTE and _inductor_seeds(tensor):
            decision.reason += (" (tagged MUST_RECOMPUTE with the random ops Inductor replaced by seeds: the seeds "
                                "are saved so that the recomputation draws the same values)")
        elif name == MUST_RECOMPUTE:
            held = saved_views.get(tensor)
            why = a.ban.get(tensor) or (f"the storage of its saved views {', '.join(view.name for view in held)}"
                                        if held else "saved as the input of another recomputation")
            decision.reason += f" (user policy {name} not applied: {why})"
            unmet.append(f"{tensor.name} ({why})")
        else:  # MUST_CPU_OFFLOAD kept: offload_tagged warned why
            decision.reason += f" (user policy {name} not applied)"
    if unmet:
        warnings.warn(f"compile_offload: {graph_name}: user policy MUST_RECOMPUTE not applied to "
                      + "; ".join(unmet) + ": saved instead", stacklevel=3)
    counts: dict[str, int] = {}
    for name in policy.policy_of.values():
        counts[name] = counts.get(name, 0) + 1
    plan.notes.append("user policy (checkpoint tags): " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
