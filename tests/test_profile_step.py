"""profile_step: the snapshot arithmetic on CPU, the recording on a GPU."""

import pytest
import torch

import compile_offload
from compile_offload.profile_step import allocated_over_time


def test_allocated_over_time_follows_allocs_and_completed_frees():
    snapshot = {"device_traces": [[
        {"action": "alloc", "size": 100},
        {"action": "alloc", "size": 50},
        {"action": "free_requested", "size": 100},
        {"action": "free_completed", "size": 100},
        {"action": "segment_alloc", "size": 4096},
    ]]}
    assert allocated_over_time(snapshot) == [100, 150, 50]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_without_a_gpu_profile_step_says_what_to_use():
    with pytest.raises(RuntimeError, match="needs a GPU.*measure_peak"):
        compile_offload.profile_step(lambda: None)


@pytest.mark.cuda
def test_profile_step_records_a_step(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).cuda()
    x = torch.randn(512, 256, device="cuda")
    compiled = torch.compile(model, backend=compile_offload.offload_remat(memory_budget=0.5))
    compiled(x).sum().backward()
    result = compile_offload.profile_step(lambda: compiled(x).sum().backward(), out=tmp_path)
    assert result["measured_peak_bytes"] > 0
    assert (tmp_path / "snapshot.pickle").stat().st_size > 0 and (tmp_path / "measured.png").stat().st_size > 0


def test_the_drawing_overlays_measured_and_predicted_timelines(tmp_path):
    from compile_offload.profile_step import _draw
    from tests.models import MLP, mlp_inputs

    plan = compile_offload.explain(MLP(), *mlp_inputs(), memory_budget=0.5, device_profile="cpu")
    assert plan.timeline_bytes and max(plan.timeline_bytes) == plan.predicted_peak_bytes
    assert 0 < plan.backward_start < len(plan.timeline_bytes)
    _draw(tmp_path / "measured.png", [0, 100, 50, 120, 0], [plan])
    png = (tmp_path / "measured.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000


def test_the_plans_drawn_by_default_are_the_latest_of_each_graph(tmp_path):
    """profile_step's default ``plans``: what the backend just partitioned, one per graph,
    the newest replacing an older plan of the same graph."""
    from compile_offload.logs import latest_plans
    from tests.models import MLP, mlp_inputs

    torch._dynamo.reset()
    for budget in (None, 0.0):
        backend = compile_offload.offload_remat(inner_compiler="eager", memory_budget=budget)
        torch._dynamo.reset()
        torch.compile(MLP(), backend=backend)(*mlp_inputs()).sum().backward()
    newest = latest_plans()[-1]
    assert newest.graph_name == "graph_0_0" and newest.budget_bytes == 0
    assert [p.graph_name for p in latest_plans()].count("graph_0_0") == 1


def test_drawing_leaves_the_users_matplotlib_backend_and_figures_alone(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from compile_offload.profile_step import _draw

    before = matplotlib.get_backend()
    plt.switch_backend("svg")  # a user's backend other than the Agg our PNGs render with
    try:
        figures = plt.get_fignums()
        _draw(tmp_path / "measured.png", [0, 100, 50], [])
        assert matplotlib.get_backend() == "svg" and plt.get_fignums() == figures
    finally:
        plt.switch_backend(before)
    assert (tmp_path / "measured.png").read_bytes().startswith(b"\x89PNG")
