"""The app's path for images, end to end: the worker process opens a vision-language model, reports it
can see images, and answers a message with an image file (the same tokens as the engine directly)."""

from __future__ import annotations

import json
import subprocess
import sys

import engine
import tests.engine.vision_fixtures as vf

QUESTION = [{"role": "user", "content": "What is in this picture?"}]


def worker_events(requests: list[dict], timeout: float = 240) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "engine", "worker"], input="".join(json.dumps(r) + "\n"
                          for r in requests), capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def test_worker_answers_with_an_image(tiny_model, tmp_path):
    folder = tiny_model("qwen2_5_vl")
    image = tmp_path / "picture.png"
    vf.picture(200, 120).save(image)
    events = worker_events([
        {"type": "load", "id": "l", "source": str(folder), "device": "sim", "backend": "torch", "budget": None},
        {"type": "generate", "id": "g", "messages": QUESTION, "params": {"max_new_tokens": 8},
         "images": [str(image)]},
        {"type": "shutdown"},
    ])
    loaded = next(e for e in events if e["type"] == "loaded")
    assert loaded["model"]["vision"] is True
    tokens = [e["token_id"] for e in events if e["type"] == "token" and e["token_id"] is not None]
    done = next(e for e in events if e["type"] == "done")
    assert done["finish_reason"] in ("length", "eos"), events
    eng = engine.open_model(folder, device="sim", backend="torch")
    want = [e.token_id for e in eng.generate(QUESTION, images=[str(image)], max_new_tokens=8) if e.token_id is not None]
    assert tokens == want
