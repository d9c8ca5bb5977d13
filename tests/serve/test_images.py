"""Images in OpenAI content parts reach `engine.generate(images=[bytes])`, with Hugging Face-style
`{"type": "image"}` parts where they were in the message (what a vision-language engine expects)."""

from __future__ import annotations

import base64

from tests.serve.conftest import KEY


class SeeingEngine:
    """The tiny engine, claiming to see: records what the API passes, answers as for the text alone."""

    supports_images = True
    submit = None              # served through `generate` (the engine's batch is tested in test_batching)

    def __init__(self, engine):
        self._engine = engine
        self.calls: list[tuple] = []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, prompt, *, images=None, **kwargs):
        self.calls.append((prompt, images))
        text_only = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
                      " ".join(p["text"] for p in m["content"] if p["type"] == "text")} for m in prompt]
        return self._engine.generate(text_only, **kwargs)

    def stats(self) -> dict:
        return {**self._engine.stats(), "prompt_tokens": 99}


def test_image_parts_are_passed_as_bytes_in_place(tiny_engine):
    import openai

    from engine.serve import ApiServer, EngineSlot

    png = b"\x89PNG\r\n\x1a\n" + bytes(range(40))
    seeing = SeeingEngine(tiny_engine)
    srv = ApiServer(EngineSlot(seeing), KEY, port=0)
    client = openai.OpenAI(api_key=KEY, base_url=srv.start(), max_retries=0, timeout=60)
    try:
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        r = client.chat.completions.create(model="vl", max_tokens=3, temperature=0, messages=[
            {"role": "system", "content": "Describe images."},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url, "detail": "low"}},
                                         {"type": "text", "text": "What is this?"},
                                         {"type": "image_url", "image_url": {"url": url}}]}])
    finally:
        srv.stop()
    prompt, images = seeing.calls[-1]
    assert images == [png, png] and all(isinstance(i, bytes) for i in images)
    assert prompt[0] == {"role": "system", "content": "Describe images."}
    assert prompt[1]["content"] == [{"type": "image"}, {"type": "text", "text": "What is this?"}, {"type": "image"}]
    assert r.usage.prompt_tokens == 99 and r.usage.completion_tokens == 3     # the engine's count, with images
