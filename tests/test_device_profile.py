"""Choosing the device profile: built-ins by name, and the measure-once-then-cache path
(exercised without a GPU by replacing the device name and the measurement)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from compile_offload.pipeline import device_profile as dp
from compile_offload.passes.cost import BUILTIN_PROFILES, DeviceProfile

FAKE_GPU = "Fake GPU 80GB"
CUDA0 = torch.device("cuda", 0)


def a_profile(name="measured:" + FAKE_GPU) -> DeviceProfile:
    return DeviceProfile(name, {"bfloat16": 7e14, "float32": 5e13}, 3e12, 5e10, 5e10, 3e-6)


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """A cache dir under tmp_path, an empty process cache and a measurement that counts its calls."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(dp, "_measured_in_process", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dp, "cuda_device_name", lambda device: FAKE_GPU)
    calls = []

    def measure(device):
        calls.append(device)
        return a_profile()

    monkeypatch.setattr(dp, "measure_device_profile", measure)
    return calls


def forget_process_cache(monkeypatch):
    monkeypatch.setattr(dp, "_measured_in_process", {})


# ---------------------------------------------------------------------------- by name

@pytest.mark.parametrize("name", ["h100", "h200", "a100", "rtx4090", "cpu"])
def test_builtin_profiles_by_name(name):
    assert dp.resolve_profile(name) is BUILTIN_PROFILES[name]
    assert dp.resolve_profile(name.upper(), CUDA0) is BUILTIN_PROFILES[name]


def test_unknown_name_lists_the_builtin_names():
    with pytest.raises(ValueError) as error:
        dp.resolve_profile("v100")
    message = str(error.value)
    assert "'v100'" in message
    for name in BUILTIN_PROFILES:
        assert name in message


def test_none_on_a_cpu_graph_or_without_cuda_is_the_cpu_profile(monkeypatch):
    assert dp.resolve_profile(None, torch.device("cpu")) is BUILTIN_PROFILES["cpu"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert dp.resolve_profile(None) is BUILTIN_PROFILES["cpu"]
    assert dp.resolve_profile(None, torch.device("meta")) is BUILTIN_PROFILES["cpu"]
    with pytest.warns(UserWarning, match="without CUDA"):
        assert dp.resolve_profile(None, CUDA0) is BUILTIN_PROFILES["cpu"]


# ---------------------------------------------------------------------------- cache

def test_cache_dir_follows_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert dp.cache_dir() == tmp_path / "xdg" / "compile_offload"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert dp.cache_dir() == tmp_path / "home" / ".cache" / "compile_offload"


def test_cache_file_is_keyed_by_device_and_torch_version(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = dp.cache_path("NVIDIA H100 80GB HBM3")
    assert path.parent == tmp_path / "compile_offload"
    assert "H100" in path.name and torch.__version__.split("+")[0] in path.name
    assert dp.cache_path("NVIDIA A100-SXM4-80GB") != path
    assert "/" not in path.name


def test_first_call_measures_and_writes_the_cache(fake_gpu):
    profile = dp.resolve_profile(None, CUDA0)
    assert profile == a_profile()
    assert fake_gpu == [CUDA0]
    record = json.loads(dp.cache_path(FAKE_GPU).read_text())
    assert DeviceProfile.from_dict(record["profile"]) == profile


def test_later_calls_reuse_the_process_cache_then_the_file(fake_gpu, monkeypatch):
    first = dp.resolve_profile(None, CUDA0)
    assert dp.resolve_profile(None, CUDA0) is first
    forget_process_cache(monkeypatch)  # a new process: only the file remains
    assert dp.resolve_profile(None, CUDA0) == first
    assert len(fake_gpu) == 1


def test_a_changed_fp32_matmul_precision_measures_again(fake_gpu, monkeypatch):
    dp.resolve_profile(None, CUDA0)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    dp.resolve_profile(None, CUDA0)
    assert len(fake_gpu) == 2


@pytest.mark.parametrize("contents", [
    "{not json",
    json.dumps({"format": dp.CACHE_FORMAT, "key": "another device", "profile": {}}),
    json.dumps([1, 2, 3]),
])
def test_a_corrupt_cache_file_warns_and_is_measured_again(fake_gpu, contents):
    path = dp.cache_path(FAKE_GPU)
    path.parent.mkdir(parents=True)
    path.write_text(contents)
    with pytest.warns(UserWarning, match="corrupt device profile cache"):
        profile = dp.resolve_profile(None, CUDA0)
    assert profile == a_profile() and len(fake_gpu) == 1
    assert dp.read_cached_profile(FAKE_GPU) == profile  # the file was repaired


def test_a_cached_profile_with_bad_values_is_corrupt(fake_gpu):
    record = {"format": dp.CACHE_FORMAT, "key": dp.cache_key(FAKE_GPU),
              "profile": dict(a_profile().to_dict(), memory_bandwidth=-1)}
    path = dp.cache_path(FAKE_GPU)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(record))
    with pytest.warns(UserWarning, match="corrupt"):
        assert dp.read_cached_profile(FAKE_GPU) is None


def test_an_unwritable_cache_warns_and_still_returns_the_profile(fake_gpu, monkeypatch, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # cache_dir() lies under a plain file
    with pytest.warns(UserWarning, match="could not cache"):
        assert dp.resolve_profile(None, CUDA0) == a_profile()
    assert not any(Path(tmp_path).glob("**/*.tmp"))


# ---------------------------------------------------------------------------- measured (GPU)

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_measured_profile_is_plausible():
    profile = dp.measure_device_profile(torch.device("cuda"))
    assert profile.name == "measured:" + torch.cuda.get_device_name()
    assert set(profile.flops_per_second) >= {"bfloat16", "float32"}
    assert profile.peak_flops(torch.bfloat16) > 1e12  # every CUDA GPU this targets beats 1 TFLOP/s
    # A device copy is faster than PCIe; PCIe (pinned) copies beat 1 GB/s.
    assert profile.memory_bandwidth > max(profile.d2h_bandwidth, profile.h2d_bandwidth) > 1e9
    assert 0 < profile.launch_overhead_seconds < 1e-4


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_resolve_none_on_a_gpu_measures_once_and_caches(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(dp, "_measured_in_process", {})
    profile = dp.resolve_profile(None)
    assert profile.name.startswith("measured:")
    assert dp.read_cached_profile(torch.cuda.get_device_name()) == profile
