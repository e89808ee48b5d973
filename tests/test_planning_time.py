"""benchmarks/planning_time.py prints one row per depth and the growth per doubling."""

import pytest
import torch

from compile_offload.benchmarks import planning_time


@pytest.mark.slow
def test_planning_time_table(capsys):
    assert planning_time.main(["--depths", "1,2", "--only", "torch-0.5,ours-none"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    header, one, two, growth = rows
    assert "torch `activation_memory_budget=0.5`" in header and "ours, no budget" in header
    nodes = [int(row.split("|")[2].replace(",", "")) for row in (one, two)]
    assert 0 < nodes[0] < nodes[1], "two layers make a larger joint graph than one"
    assert all(cell.strip().endswith(" s") for row in (one, two) for cell in row.split("|")[3:5])
    assert growth.startswith("| growth per doubling") and growth.count("x") == 2


def test_planning_time_rejects_unknown_columns():
    with pytest.raises(SystemExit):
        planning_time.main(["--only", "ours-0.3"])


def test_planning_time_rejects_fewer_than_one_run():
    with pytest.raises(SystemExit):
        planning_time.main(["--repeat", "0"])


@pytest.mark.slow
def test_repeated_runs_report_the_least_time(monkeypatch):
    """With ``repeat``, each column is timed that many times, in turns, and the least is kept."""
    calls = []
    readings = iter([0.0, 5.0, 10.0, 12.0])  # the first run takes 5 s, the second 2 s

    monkeypatch.setattr(planning_time, "partitioners", lambda: {"ours-none": lambda *args: calls.append(args)})
    _, times = planning_time.time_depth(1, "gpt", ["ours-none"], clock=lambda: next(readings), repeat=2)
    assert len(calls) == 2 and times == {"ours-none": 2.0}


def test_repeated_runs_take_turns_over_the_depths(monkeypatch):
    """Each round times every depth, so a slow stretch of the machine falls on all of them."""
    graph = torch.fx.Graph()
    graph.output(())
    monkeypatch.setattr(planning_time, "capture_joint",
                        lambda layers, shape: (torch.fx.GraphModule({}, graph), [], 0))
    order = []
    monkeypatch.setattr(planning_time, "partitioners",
                        lambda: {"ours-none": lambda gm, inputs, n: order.append("ours")})
    lines = []
    results = planning_time.time_depths([1, 2], "gpt", ["ours-none"], repeat=2, progress=lines.append)
    assert [line.split(",")[:2] for line in lines] == [["run 1/2", " 1 layers"], ["run 1/2", " 2 layers"],
                                                      ["run 2/2", " 1 layers"], ["run 2/2", " 2 layers"]]
    assert len(order) == 4 and set(results) == {1, 2}


def test_our_columns_plan_for_the_gpus_kernels(monkeypatch):
    """The graphs are traced on CPU tensors (their values say CPU), but the h100 profile
    plans a GPU's step: ours is told the kernels are an accelerator's (Triton's), as
    ``explain`` tells it for a GPU profile on host tensors; torch's columns are untouched."""
    from compile_offload.pipeline import partitioner

    made = []

    class Recording:
        def __init__(self, settings, **kwargs):
            made.append((settings.device_profile, kwargs.get("accelerator")))

        def __call__(self, *args, **kwargs):
            return None

    monkeypatch.setattr(partitioner, "OffloadRematPartitioner", Recording)
    table = planning_time.partitioners()
    for column in ("ours-none", "ours-0.5", "ours-2GiB"):
        table[column](None, [], 1)
    assert made == [("h100", True)] * 3
