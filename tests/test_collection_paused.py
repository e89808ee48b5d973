"""Planning pauses Python's cyclic collector and leaves it as it found it."""

import gc

import pytest

from compile_offload.pipeline.collection_paused import collection_paused


@pytest.fixture
def collector_state():
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


@pytest.mark.parametrize("enabled", [True, False])
def test_paused_inside_and_restored_after(collector_state, enabled):
    (gc.enable if enabled else gc.disable)()
    with collection_paused():
        assert not gc.isenabled()
    assert gc.isenabled() == enabled


def test_restored_when_planning_raises(collector_state):
    gc.enable()
    with pytest.raises(RuntimeError), collection_paused():
        raise RuntimeError("planning failed")
    assert gc.isenabled()


def test_plan_partition_restores_the_collector(collector_state):
    import torch
    from torch._functorch.aot_autograd import aot_module_simplified

    from compile_offload.pipeline.planning import plan_partition
    from compile_offload.settings import resolve

    seen = []

    def partition(joint, inputs, **kwargs):
        settings = resolve({"memory_budget": 0.5})
        result = plan_partition(joint, inputs, settings, num_fwd_outputs=kwargs["num_fwd_outputs"])
        seen.append(gc.isenabled())
        return result.fw_gm, result.bw_gm

    def backend(gm, inputs):
        return aot_module_simplified(gm, inputs, fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g,
                                     partition_fn=partition)

    gc.enable()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    torch._dynamo.reset()
    torch.compile(model, backend=backend)(torch.randn(4, 8)).sum().backward()
    assert seen == [True]
