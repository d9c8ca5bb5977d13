"""The official `openai` client against the server: streamed and whole chat completions, completions,
models, usage counts, finish reasons, stop strings, and greedy output equal to `engine.generate`'s."""

from __future__ import annotations

import threading

import openai
import pytest

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there, how are you?"}]


def _greedy(engine, prompt, n: int) -> tuple[str, str]:
    events = list(engine.generate(prompt, max_new_tokens=n, temperature=0.0))
    return "".join(e.text for e in events), events[-1].finish_reason


def test_streamed_chat_completion(client, tiny_engine):
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) > 1                                    # it really streamed, piece by piece
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == len(tiny_engine.encode_prompt(MESSAGES))
    assert len({c.id for c in chunks}) == 1
    assert "".join(content) == _greedy(tiny_engine, MESSAGES, 12)[0]


def test_whole_chat_completion_usage_and_model(client, tiny_engine):
    r = client.chat.completions.create(model="anything", messages=MESSAGES, max_completion_tokens=9, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 9
    assert r.usage.total_tokens == r.usage.prompt_tokens + 9
    assert r.model == client.models.list().data[0].id           # the loaded model answers whatever the name
    assert choice.message.content == _greedy(tiny_engine, MESSAGES, 9)[0]


@pytest.mark.parametrize("n", [1, 7, 40])
def test_greedy_output_through_the_api_equals_engine_generate(client, tiny_engine, n):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=n, temperature=0)
    text, reason = _greedy(tiny_engine, MESSAGES, n)
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == {"eos": "stop", "stop": "stop", "length": "length"}[reason]
    prompt = "The quick brown fox"
    c = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0)
    assert c.choices[0].text == _greedy(tiny_engine, prompt, n)[0]


def test_completions_whole_and_streamed(client, tiny_engine):
    prompt = "Once upon a time"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, seed=3)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tiny_engine.encode_prompt(prompt)) and r.usage.completion_tokens == 10
    pieces = list(client.completions.create(model="tiny", prompt=[prompt], max_tokens=10, temperature=0,
                                            stream=True))
    assert "".join(p.choices[0].text for p in pieces) == r.choices[0].text
    assert pieces[-1].choices[0].finish_reason == "length"


def test_models_list_and_one_model(client, tiny_engine, tiny_model):
    models = client.models.list().data
    assert [m.id for m in models] == [tiny_model("llama").name]
    assert models[0].owned_by == "slipstream"
    assert client.models.retrieve(models[0].id).id == models[0].id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_stop_string_ends_with_finish_reason_stop(client, tiny_engine):
    full, _ = _greedy(tiny_engine, MESSAGES, 30)
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert stop.strip()
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[:full.index(stop)]


def test_sampling_with_a_seed_repeats(client):
    kw = {"model": "tiny", "messages": MESSAGES, "max_tokens": 15, "temperature": 1.0, "top_p": 0.9, "seed": 42}
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_concurrent_requests_queue_and_all_succeed(client, tiny_engine):
    expected = _greedy(tiny_engine, MESSAGES, 8)[0]
    results: list[str] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
            results.append(r.choices[0].message.content)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and results == [expected] * 4
