"""torch's budget plan, read back by model-check, is the plan torch.compile makes: the saved
set ``compat.budget_saved_values`` chooses on ``model_check.capture_joint``'s graph equals what
the real compile's partition saves (its backward's inputs), on the same model."""

from __future__ import annotations

import pytest
import torch

from compile_offload.benchmarks.workloads import Decoder
from compile_offload.tools.model_check import capture_joint, decoder_on_meta
from compile_offload.passes import compat

pytestmark = [pytest.mark.inductor, pytest.mark.slow]

# Small enough to compile in seconds; large enough that Inductor's joint-graph passes change
# what torch's knapsack saves at 0.5 (read back before them, it saved two more tensors).
ARGS = {"layers": 2, "d": 128, "heads": 2, "ff": 512, "seq": 256, "batch": 2, "dtype": "bfloat16"}


def _compute(names: set[str]) -> set[str]:
    return {name for name in names if not name.startswith(("primals", "tangents", "permute"))}


def test_torchs_budget_plan_is_read_back_on_the_graph_torch_compile_partitions(monkeypatch):
    from torch._inductor import compile_fx

    real = compile_fx.min_cut_rematerialization_partition
    saved_by_compile: list[set[str]] = []

    def recording(gm, joint_inputs, **kwargs):
        fw, bw = real(gm, joint_inputs, **kwargs)
        saved_by_compile.append({n.name for n in bw.graph.nodes if n.op == "placeholder"})
        return fw, bw

    monkeypatch.setattr(compile_fx, "min_cut_rematerialization_partition", recording)
    torch.manual_seed(0)
    dtype = getattr(torch, ARGS["dtype"])
    model = Decoder(ARGS["layers"], ARGS["d"], ARGS["heads"]).to(dtype)
    x = torch.randn(ARGS["batch"], ARGS["seq"], ARGS["d"], dtype=dtype, requires_grad=True)
    torch._dynamo.reset()
    with torch._functorch.config.patch(activation_memory_budget=0.5, enable_autograd_cache=False), \
            torch._inductor.config.patch(fx_graph_cache=False):
        torch.compile(model)(x).float().pow(2).mean().backward()
    torch._dynamo.reset()
    assert len(saved_by_compile) == 1

    joint = capture_joint(*decoder_on_meta(ARGS))
    read_back = {n.name for n in compat.budget_saved_values(joint, 0.5)}
    assert _compute(read_back) and _compute(read_back) == _compute(saved_by_compile[0])
