"""Small pieces: markdown segments, the budget controller, the model catalog, charts' bounded memory,
the protocol's line decoder and version, the single-instance guard."""

from __future__ import annotations

import json
import re
import time

import numpy as np

from app.budget import BudgetController
from app.charts.ring_buffer import RingBuffer
from app.model_catalog import BUNDLED_LABEL, discover_models
from app.ui.markdown_segments import split_markdown
from app.worker_protocol import PROTOCOL_VERSION, LineDecoder, encode_request


def test_markdown_split_prose_and_code():
    text = "Here:\n\n```python\nprint('hi')\n```\nDone."
    segs = split_markdown(text)
    assert [(s.kind, s.lang) for s in segs] == [("text", ""), ("code", "python"), ("text", "")]
    assert segs[1].text == "print('hi')" and segs[1].closed


def test_markdown_unclosed_fence_while_streaming():
    segs = split_markdown("Try:\n~~~\nls -la\n")
    assert segs[-1].kind == "code" and not segs[-1].closed and segs[-1].text.startswith("ls -la")


def test_budget_controller_modes(qtbot):
    b = BudgetController("auto")
    seen = []
    b.budgetChanged.connect(seen.append)
    b.on_monitor(6 << 30, gaming=False)
    assert seen == [6 << 30]
    b.set_cap(2 << 30)
    assert b.mode == "fixed" and seen[-1] == 2 << 30
    b.on_monitor(5 << 30, gaming=True)          # fixed: the monitor does not move it
    assert seen[-1] == 2 << 30
    b.set_mode("pause_when_gaming")
    assert seen[-1] == 0 and b.paused
    b.on_monitor(5 << 30, gaming=False)
    assert seen[-1] == 5 << 30 and not b.paused
    n = len(seen)
    b.on_monitor(5 << 30, gaming=False)
    assert len(seen) == n                       # no change, no signal


def test_model_catalog_finds_the_usual_places(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    snap = tmp_path / ".cache/huggingface/hub/models--Qwen--Qwen2.5-0.5B/snapshots/abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (snap / "model.safetensors").write_bytes(b"x")
    lms = tmp_path / ".lmstudio/models/lmstudio-community/Llama-3.2-1B-GGUF"
    lms.mkdir(parents=True)
    (lms / "Llama-3.2-1B-Q4_K_M.gguf").write_bytes(b"GGUF")
    (lms / "mmproj-model-f16.gguf").write_bytes(b"GGUF")
    ollama = tmp_path / ".ollama/models"
    (ollama / "blobs").mkdir(parents=True)
    (ollama / "blobs/sha256-1234").write_bytes(b"GGUF")
    manifest = ollama / "manifests/registry.ollama.ai/library/llama3.2/latest"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                                "digest": "sha256:1234"}]}))
    entries = discover_models(home=tmp_path)
    labels = [e.label for e in entries]
    assert labels[0] == BUNDLED_LABEL and entries[0].source is None
    assert "Qwen/Qwen2.5-0.5B (Hugging Face)" in labels
    assert "Llama-3.2-1B-Q4_K_M (LM Studio)" in labels
    assert "llama3.2:latest (Ollama)" in labels
    assert not any("mmproj" in label for label in labels)
    assert discover_models(home=tmp_path / "nobody") == entries[:1]


def test_charts_use_bounded_memory(qtbot):
    from app.charts.plan_chart import MAX_SEGMENTS, PlanChart

    ring = RingBuffer(100, 3)
    for i in range(1000):
        ring.append(i, i * 2, None)
    rows = ring.view()
    assert len(rows) == 100 and rows[0, 0] == 900 and rows[-1, 0] == 999
    chart = PlanChart()
    t = time.time()
    for i in range(MAX_SEGMENTS * 3):     # a re-plan at every tick for a long time
        kind = "static" if i % 2 else "dynamic"
        chart.sample(t + i, {"tiers": [{"tokens": 1, "plan": kind, "placement": {"a": "resident"}}]})
        chart.mark_replan(t + i, "budget")
    assert len(chart.segments[1]) == MAX_SEGMENTS
    chart.redraw(t + MAX_SEGMENTS * 3)


def test_line_decoder_splits_events_and_keeps_partial_lines():
    dec = LineDecoder()
    events, junk = dec.feed(b'{"type":"ready","protocol":1}\n{"type":"tok')
    assert events == [{"type": "ready", "protocol": 1}] and junk == []
    events, junk = dec.feed(b'en","id":"g","text":"h\xc3\xa9"}\nstray print\n')
    assert events == [{"type": "token", "id": "g", "text": "hé"}] and junk == ["stray print"]
    assert encode_request("cancel", id="g") == b'{"type":"cancel","id":"g"}\n'


def test_both_sides_speak_the_same_protocol_version():
    from engine.worker import PROTOCOL_VERSION as WORKER_VERSION

    assert WORKER_VERSION == PROTOCOL_VERSION


def test_single_instance(qtbot):
    from app.single_instance import SingleInstance

    first = SingleInstance()
    assert not first.notify_running()
    assert first.listen()
    second = SingleInstance()
    with qtbot.waitSignal(first.messageReceived, timeout=5_000) as got:
        assert second.notify_running("show-chat")
    assert got.args == ["show-chat"]
    first.close()


def test_chart_axes_keep_their_own_units_at_small_values(qtbot):
    """A single plan tier (the llama.cpp backend plans one) spans less than one unit, as does a decode under
    one token a second: the axes label the values as they are, with no "(x0.001)" scale beside the name."""
    from app.charts.plan_chart import PlanChart
    from app.charts.speed_chart import SpeedChart

    t = time.time()
    plan = PlanChart()
    plan.sample(t, {"tiers": [{"tokens": 1, "plan": "static", "placement": {"a": "cpu"}}]})
    plan.redraw(t + 1)
    speed = SpeedChart()
    for i in range(5):
        speed.add(t + i, 0.3 + 0.01 * i)
    speed.redraw(t + 5)
    for chart, name in ((plan, "tier"), (speed, "tokens/s")):
        qtbot.addWidget(chart.widget)
        axis = chart.widget.getAxis("left")
        axis.updateAutoSIPrefix()
        text = re.sub(r"<[^>]+>", "", axis.labelString()).strip()
        assert text == name, axis.labelString()


def test_the_vram_chart_draws_the_budget_only_where_it_is(qtbot):
    """Without a GPU total to scale to, a budget on the chart's scale is drawn where it is; one off the scale
    (an engine holding no VRAM, as llama.cpp on the CPU under a 600 MiB cap) is not drawn at all, rather
    than clipped onto the data as if it were there."""
    from app.charts.vram_chart import VramChart

    mib, t = 1 << 20, time.time()
    nan = float("nan")
    for own, budget, drawn in ((800 * mib, 637 * mib, 637.0), (0.0, 600 * mib, None)):
        chart = VramChart()
        qtbot.addWidget(chart.widget)
        for i in range(4):
            chart.add(t + i, own, nan, nan, budget, nan)
        chart.redraw(t + 4)
        ys = chart._budget.getData()[1]
        assert re.sub(r"<[^>]+>", "", chart.widget.getAxis("left").labelString()).strip() == "MiB"
        if drawn is None:
            assert ys is None or not np.isfinite(ys).any()
        else:
            assert np.allclose(ys, drawn)
