"""Configuration knobs of the ``offload_remat`` backend.

Built with ``torch.utils._config_module.install_config_module`` like
``torch._functorch.config``, so it supports::

    import compile_offload
    compile_offload.config.memory_budget = "6GiB"
    with compile_offload.config.patch(memory_budget=0.5):
        ...
    @compile_offload.config.patch(offload=False)
    def test(): ...

Every knob can also be set through an environment variable
``COMPILE_OFFLOAD_<NAME>`` (read once, when ``compile_offload`` is imported), and per
call with ``torch.compile(model, backend="offload_remat", options={...})`` or
``compile_offload.offload_remat(**options)``.

Values are validated (``compile_offload.settings.resolve``) no later than the first
compile; a bad value raises ``ValueError``/``TypeError`` naming the knob.

When values are read: when each graph is compiled (its first call, not ``torch.compile``),
and compared at every call of the compiled graph: a call under other values compiles
again for them (``config_guard.py``). An assignment applies to every thread, a
``config.patch`` to its own (``process_config.py``). ``docs/reference.md``, "When the config is
read", also covers dynamic shapes and warm caches.
"""

import sys
from typing import Optional

from .torch_api.utils import Config, install_config_module, keep_environment_strings

# Memory budget for one compiled forward+backward graph. Accepted values:
#   None            no limit: the fastest plan (same saved set as torch.compile's default).
#   int             bytes, e.g. 4 * 2**30.
#   str with units  "512MiB", "6GB", "6GiB", "1.5 GiB", "1000000" (bytes).
#   float in [0, 1] that fraction of the activation memory the unconstrained plan saves
#                   for the backward (its peak less the rest of those saved bytes: the
#                   measure of torch's activation_memory_budget); 0.0 asks for the
#                   minimum-memory plan.
# The budget bounds the peak memory one compiled forward+backward allocates above what
# was allocated when it started (saved activations, transient buffers, gradients), which
# is what torch.cuda.max_memory_allocated() minus the allocation before the step measures.
# With several graphs (graph breaks) it applies to each graph separately.
# None with torch._functorch.config.activation_memory_budget below 1.0: torch's knob is used
# as the fraction (the same measure; said once in the log). Both set: this one wins, with
# one warning if they differ.
# A byte budget above the memory of the CUDA device (or, planning without one, of the GPU
# a named device_profile describes) is an error: it could never bind.
memory_budget = Config(default=None, env_name_default="COMPILE_OFFLOAD_MEMORY_BUDGET", value_type=Optional[str])

# Raise instead of warning when the budget is below the minimum achievable peak.
strict_budget: bool = Config(default=False, env_name_default="COMPILE_OFFLOAD_STRICT_BUDGET")

# Allow the planner to copy saved tensors to pinned host memory during forward and back
# during backward.
offload: bool = Config(default=True, env_name_default="COMPILE_OFFLOAD_OFFLOAD")

# Prefetch reloads ahead of their first use in backward. False reloads right before use
# (a debugging switch: slower, but isolates prefetch bugs).
prefetch: bool = Config(default=True, env_name_default="COMPILE_OFFLOAD_PREFETCH")

# Offload every eligible saved tensor, whatever the budget says (tests and debugging).
# The copies are placed as a planned offload's would be under device_profile (where the
# forward waits, how far ahead each reload is issued: passes/transfer.py), so a CPU run
# with a GPU profile exercises the placement a GPU run gets.
# Needs offload=True: with offload=False the settings raise ValueError.
debug_force_offload: bool = Config(default=False, env_name_default="COMPILE_OFFLOAD_DEBUG_FORCE_OFFLOAD")

# Which solver picks keep / recompute per saved tensor: "greedy" (default, fast),
# "refined" (the greedy, then passes/solve/refine.py undoes the moves the budget does not need:
# closer to the optimum under the planner's model, but it spends the room the greedy
# leaves under the budget, and under Inductor the simulator's errors can then show as a
# measured overrun or, after the budget loop re-plans, as a prediction far from the measured
# peak: docs/design.md, "Refinement"), or "exact" (exhaustive search over
# which storages to recompute, each plan simulated: optimal under the planner's model, for
# graphs with at most exact_max_candidates candidate storages; larger graphs fall back to
# greedy with a warning).
solver: str = Config(default="greedy", env_name_default="COMPILE_OFFLOAD_SOLVER")

# The exact solver refuses graphs with more candidate storages than this (2**n plans).
exact_max_candidates = Config(default=12, env_name_default="COMPILE_OFFLOAD_EXACT_MAX_CANDIDATES", value_type=Optional[str])

# Seconds one graph's planning may take (None: no limit). When they run out, the solver
# stops searching and returns the best plan among those it has simulated (the
# unconstrained plan at least), with one warning. Planning longer than about 5 s reports
# its progress on stderr and on the compile_offload logger either way.
plan_time_limit = Config(default=None, env_name_default="COMPILE_OFFLOAD_PLAN_TIME_LIMIT", value_type=Optional[str])

# Folder for dumped graphs and plans (one sub-folder per compiled graph). None: no dump.
dump_dir = Config(default=None, env_name_default="COMPILE_OFFLOAD_DUMP_DIR", value_type=Optional[str])

# Folder of saved plans: a compile whose graph, budget, knobs, device profile, torch
# version and compile_offload version match a saved plan reuses it instead of solving
# again. A stale or corrupt entry is ignored with a warning. None: no cache.
plan_cache_dir = Config(default=None, env_name_default="COMPILE_OFFLOAD_PLAN_CACHE_DIR", value_type=Optional[str])

# Device profile of the cost model: None measures the current device once (cached in the
# user cache dir; the built-in "cpu" profile on machines without a GPU), or a built-in
# name: "h100", "h200", "a100", "rtx4090", "cpu". A GPU profile for a training graph on a non-CUDA
# device warns (the plan stays correct; its trade-offs are that GPU's); explain() plans for
# a GPU on a CPU-only machine without a warning.
device_profile = Config(default=None, env_name_default="COMPILE_OFFLOAD_DEVICE_PROFILE", value_type=Optional[str])

# Compiler for the partitioned forward and backward graphs: "inductor" (default) or
# "eager" (runs the partitioned FX graphs as Python, no code generation: fast to
# compile, handy when debugging a plan).
inner_compiler: str = Config(default="inductor", env_name_default="COMPILE_OFFLOAD_INNER_COMPILER")

# Upper bound in bytes of the pinned host memory pool used by offload (None: no limit).
# The pool is one per process: the limit of the latest compile with offload on applies to
# every model (a compile with offload=False does not use the pool and leaves its limit).
pinned_pool_limit = Config(default=None, env_name_default="COMPILE_OFFLOAD_PINNED_POOL_LIMIT", value_type=Optional[str])

# What to do when the planner fails on a graph for a reason it does not know to be
# unsupported (a bug of ours): False (default) raises, so the failure is seen and reported;
# True falls back to torch's default partition for that graph (correct, but without the
# memory budget) with one warning, as for graphs known to be unsupported (higher-order ops
# with subgraphs), which always fall back.
suppress_errors: bool = Config(default=False, env_name_default="COMPILE_OFFLOAD_SUPPRESS_ERRORS")

# Measure the first compiled step (forward and backward) of each graph at the allocator
# (compile_offload.measure_peak: CUDA's max_memory_allocated, the CPU allocator's events
# through the profiler) and warn once, with the measured peak, the budget and the
# predicted peak, when the measurement exceeds the budget by more than 1%. The first thing
# to turn on when memory surprises you. Costs one profiled step per graph on the CPU and
# turns off Inductor's and AOTAutograd's caches for the graphs it compiles (a cache hit
# would bring no plan to compare with). Graphs without a budget are not measured.
verify_budget: bool = Config(default=False, env_name_default="COMPILE_OFFLOAD_VERIFY_BUDGET")

# What a byte memory_budget bounds where Dynamo compiles the model into several graphs
# (graph breaks): "graph" (default) each graph's forward+backward, so a step of N graphs may
# use up to N budgets; "step" the whole training step: the graphs first run their
# minimum-memory plans, and once the first step has ended the budget is split between them
# by what each can use (runtime/step_budget.py), each graph compiled again under its share.
# A fraction stays relative to each graph's own activations. DDPOptimizer's bucket graphs are
# split by need under "step" (evenly under "graph"); the parameters FSDP2 gathers outside the
# graphs are held back first, and on CUDA the second step under the split is measured and
# the split corrected where it is over.
budget_scope: str = Config(default="graph", env_name_default="COMPILE_OFFLOAD_BUDGET_SCOPE")

# Bytes another user of the host link copies host->device as each backward of the graph
# starts (FSDP2 uploading the next module's CPU-offloaded parameters; compile_offload.fit sets
# it): the plan's reloads queue behind that copy, so it offloads less where the link is busy.
# An int or a size string; 0 (default): the link is the plan's alone.
shared_h2d_bytes = Config(default=0, env_name_default="COMPILE_OFFLOAD_SHARED_H2D_BYTES", value_type=Optional[str])

# Measured plan choice: under a budget, with Inductor, compile a few candidate plans whose
# Inductor code fits the budget (the planner's plan, plans made a little above and below
# it, and without offload where it offloads), run the first training steps on them in turn
# (each a real step: its gradients are right), and keep the planner's plan unless a rival
# whose measured peak fits was faster in every timed step (its median by more than 1%). The
# planner's cost model guides the search; this lets the device decide between near-equal
# plans. Costs one extra Inductor compile per candidate and
# (candidates x (measured_plan_steps + 1)) steps at most on the candidates (one more each
# on the CPU, whose peak is measured in a step of its own); with plan_cache_dir set, the
# winner is stored and later runs skip the trials. Turns off Inductor's and AOTAutograd's
# caches for the graphs it compiles. Off where it cannot help: no budget,
# inner_compiler="eager", CUDA graphs, graphs with dynamic sizes.
measured_plan_choice: bool = Config(default=False, env_name_default="COMPILE_OFFLOAD_MEASURED_PLAN_CHOICE")

# Timed steps per candidate plan of measured_plan_choice (after one warm-up step each).
measured_plan_steps = Config(default=3, env_name_default="COMPILE_OFFLOAD_MEASURED_PLAN_STEPS", value_type=Optional[str])

install_config_module(sys.modules[__name__])
# A knob that is not a flag reads COMPILE_OFFLOAD_<NAME>=0 or 1 as the string "0" or "1" (0 or 1
# bytes, steps, seconds), as any other value of the variable, not as the bool torch reads.
keep_environment_strings(sys.modules[__name__], lambda knob: f"COMPILE_OFFLOAD_{knob.upper()}")

# An assignment reaches every thread (torch >= 2.12 would keep it in the assigning
# thread's context only); config.patch stays per thread. See process_config.py.
from .process_config import install as _install_process_wide  # noqa: E402

_install_process_wide(sys.modules[__name__])
