"""The CUDA allocator's expandable segments: set before the engine's first allocation by default, left alone
with SLIPSTREAM_EXPANDABLE_SEGMENTS=0 and when the user configured the allocator (the setting itself only acts
on CUDA; here the setter is recorded)."""

from __future__ import annotations

import torch

from engine.sharding import device


def _recording(monkeypatch) -> list[str]:
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append, raising=False)
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "SLIPSTREAM_EXPANDABLE_SEGMENTS"):
        monkeypatch.delenv(var, raising=False)
    return calls


def test_expandable_segments_are_on_by_default_and_off_when_asked(monkeypatch):
    calls = _recording(monkeypatch)
    assert device.expandable_segments() is True
    assert calls == ["expandable_segments:True"]
    for off in ("0", "off", "False"):
        monkeypatch.setenv("SLIPSTREAM_EXPANDABLE_SEGMENTS", off)
        assert device.expandable_segments() is False
    assert calls == ["expandable_segments:True"]
    monkeypatch.setenv("SLIPSTREAM_EXPANDABLE_SEGMENTS", "1")
    assert device.expandable_segments() is True


def test_a_users_allocator_setting_wins(monkeypatch):
    calls = _recording(monkeypatch)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert device.expandable_segments() is False
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    assert device.expandable_segments() is False
    assert calls == []


def test_the_sim_accelerator_reports_no_expandable_segments(monkeypatch):
    calls = _recording(monkeypatch)
    accel = device.Accelerator("sim")
    assert accel.expandable_segments is False and calls == []
