"""The NVML wrapper: every failure is a value; a missing library or driver is a reason, not a crash."""

from __future__ import annotations

import sys

import pytest

from monitor.fake_nvml import ERROR_CLASSES, FakeNvml, error
from monitor.nvml import NotAvailable, Nvml
from tests.monitor.helpers import TRACES


class Broken:
    """A library whose every call raises what it is given."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def __getattr__(self, name):
        def fn(*args):
            raise self.exc
        return fn


def test_call_turns_errors_into_values_and_marks_the_fatal_ones():
    nv = Nvml(Broken(error("NotSupported")))
    v = nv.call("nvmlDeviceGetUtilizationRates", 0)
    assert isinstance(v, NotAvailable) and not v and v.reason == "Not Supported" and not v.fatal
    lost = Nvml(Broken(error("GpuIsLost"))).call("nvmlDeviceGetMemoryInfo", 0)
    assert lost.reason == "GPU is lost" and lost.fatal
    other = Nvml(Broken(OSError("boom"))).call("nvmlInit")
    assert other.reason == "OSError: boom" and not other.fatal
    assert Nvml(object()).call("nvmlDeviceGetNothing").reason.startswith("AttributeError")


def test_open_reports_why_and_retries_no_faster_than_asked():
    nv = Nvml(Broken(error("DriverNotLoaded")), retry_s=3600)
    assert nv.open() == "NVML did not start (Driver Not Loaded)" and not nv.ready
    assert nv.open() == "NVML did not start (Driver Not Loaded)"


def test_open_with_the_fake_names_the_devices():
    nv = Nvml(FakeNvml(TRACES / "two_gpus.json"))
    assert nv.open() == "" and nv.ready
    assert nv.names == ["NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 3060"]
    nv.close("test")
    assert not nv.ready and nv.reason == "test"


def test_missing_nvidia_ml_py_is_a_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert Nvml().open() == "nvidia-ml-py is not installed"


def test_real_pynvml_on_a_machine_without_a_gpu_does_not_raise():
    pytest.importorskip("pynvml")
    nv = Nvml()
    reason = nv.open()
    assert nv.ready == (reason == "")


def test_fake_errors_look_like_pynvml():
    for name, cls in ERROR_CLASSES.items():
        assert cls.__name__ == f"NVMLError_{name}"
    fake = FakeNvml(TRACES / "no_driver.json")
    with pytest.raises(fake.NVMLError_DriverNotLoaded):
        fake.nvmlInit()
    with pytest.raises(fake.NVMLError):
        fake.nvmlDeviceGetCount()          # not initialised
    with pytest.raises(ValueError, match="'Nope'"):
        error("Nope")
