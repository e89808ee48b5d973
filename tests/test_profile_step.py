"""profile_step: the snapshot arithmetic on CPU, the recording on a GPU."""

import pytest
import torch

import compile_offload
from compile_offload.tools.profile_step import (
    allocated_over_time,
    allocator_block_bytes,
    describe_live_at_peak,
    live_at_peak,
)


def test_allocated_over_time_follows_allocs_and_completed_frees():
    snapshot = {"device_traces": [[
        {"action": "alloc", "size": 1024},
        {"action": "alloc", "size": 512},
        {"action": "free_requested", "size": 1024},
        {"action": "free_completed", "size": 1024},
        {"action": "segment_alloc", "size": 4096},
    ]]}
    assert allocated_over_time(snapshot) == [1024, 1536, 512]


def test_requests_count_as_the_allocators_512_byte_blocks():
    """The trace records what was asked for; ``memory_allocated`` counts the block."""
    assert [allocator_block_bytes(n) for n in (0, 1, 4, 512, 513, 1_131_875)] == [0, 512, 512, 512, 1024, 1_132_032]
    snapshot = {"device_traces": [[
        {"action": "alloc", "addr": 1, "size": 4},
        {"action": "alloc", "addr": 2, "size": 1000},
        {"action": "free_completed", "addr": 1, "size": 4},
    ]]}
    assert allocated_over_time(snapshot) == [512, 1536, 1024]
    peak, blocks = live_at_peak(snapshot)
    assert peak == 1536 and [b.nbytes for b in blocks] == [1024, 512]


def test_live_at_peak_lists_the_blocks_alive_at_the_first_maximum(tmp_path):
    source = tmp_path / "program.py"
    source.write_text("buf0 = empty(1024)\nbuf1 = empty(512)\n")
    where = {"filename": str(source), "name": "call"}
    snapshot = {"device_traces": [[
        {"action": "alloc", "addr": 1, "size": 1024, "frames": [{**where, "line": 1}]},
        # A free whose stream work is pending: still allocated until it completes.
        {"action": "free_requested", "addr": 1, "size": 1024},
        {"action": "alloc", "addr": 2, "size": 512, "frames": [{**where, "line": 2}]},
        {"action": "free_completed", "addr": 1, "size": 1024},
        {"action": "free_completed", "addr": 99, "size": 512},  # allocated before recording began
        {"action": "alloc", "addr": 3, "size": 1536, "frames": []},  # 1536 again: not a new peak
        {"action": "segment_alloc", "addr": 7, "size": 4096},
    ]]}
    peak, blocks = live_at_peak(snapshot)
    assert peak == 1536
    assert [b.nbytes for b in blocks] == [1024, 512]
    assert blocks[0].frames == [f"{source}:1 in call: buf0 = empty(1024)"]
    text = describe_live_at_peak(snapshot)
    assert text.splitlines()[0].startswith("peak 1536 bytes") and "buf1 = empty(512)" in text


def test_the_contract_records_snapshots_on_cuda_only():
    from compile_offload.benchmarks import budget_contract

    with pytest.raises(ValueError, match="CUDA only"):
        budget_contract.measure_point("mlp_mixer", None, snapshot="live.txt")
    with pytest.raises(SystemExit):
        budget_contract.main(["--snapshot", "live.txt"])


@pytest.mark.cuda
def test_the_snapshot_peak_is_the_allocators(tmp_path):
    """The replayed history's peak is what ``max_memory_allocated`` says for the same step."""
    from compile_offload.benchmarks.budget_contract import recorded

    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).cuda()
    x = torch.randn(512, 256, device="cuda")
    model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    out = tmp_path / "live.txt"
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with recorded(str(out), "mlp"):
        model(x).sum().backward()
    measured = torch.cuda.max_memory_allocated() - start
    first = out.read_text().splitlines()[1]
    assert first.startswith(f"peak {measured} bytes"), (first, measured)


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
    pytest.importorskip("matplotlib")  # the optional plot extra draws the figures this test reads
    from compile_offload.tools.profile_step import _draw
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
    from compile_offload.reporting.logs import latest_plans
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

    from compile_offload.tools.profile_step import _draw

    before = matplotlib.get_backend()
    plt.switch_backend("svg")  # a user's backend other than the Agg our PNGs render with
    try:
        figures = plt.get_fignums()
        _draw(tmp_path / "measured.png", [0, 100, 50], [])
        assert matplotlib.get_backend() == "svg" and plt.get_fignums() == figures
    finally:
        plt.switch_backend(before)
    assert (tmp_path / "measured.png").read_bytes().startswith(b"\x89PNG")
