"""The engine tokenizer against transformers' AutoTokenizer, and chat-template rendering."""

from __future__ import annotations

import json
import shutil

import pytest

from engine.errors import BadInputError
from engine.loading import load_tokenizer
from engine.loading.tokenizer import render_chat_template

ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3"]
TEXTS = [
    "Hello world",
    " Hello  world!\n\n",
    "The year 2024 has 365 days; π≈3.14159.",
    "ünïcödé façade — naïve café 日本語 🎉",
    "def f(x):\n\treturn x**2  # comment\n",
    "<|im_start|>user\nWhat's up?<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure they'll've DONE it",
    "   leading and trailing   ",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "  And 3+3?  "}],
]


@pytest.fixture(scope="module")
def pair(tiny_model):
    from transformers import AutoTokenizer

    def make(arch):
        path = tiny_model(arch)
        return load_tokenizer(path), AutoTokenizer.from_pretrained(path)

    return make


@pytest.mark.parametrize("arch", ARCHS)
def test_encode_decode_match_transformers(pair, arch):
    ours, hf = pair(arch)
    for text in TEXTS:
        assert ours.encode(text) == hf(text, add_special_tokens=False)["input_ids"], text
        assert ours.encode(text, add_special_tokens=True) == hf(text)["input_ids"], text
        ids = hf(text)["input_ids"]
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids), text
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.add_bos == (arch in ("llama", "llama3", "mistral"))
    assert hf.eos_token_id in ours.eos_token_ids
    assert ours.vocab_size == len(hf)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_matches_transformers(pair, arch, generation_prompt):
    ours, hf = pair(arch)
    for messages in CONVERSATIONS:
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        assert ours.apply_chat_template(messages, add_generation_prompt=generation_prompt) == expected


def test_template_raise_exception_is_bad_input(pair):
    ours, _ = pair("qwen3")
    with pytest.raises(BadInputError, match="Unknown role: robot"):
        ours.apply_chat_template([{"role": "robot", "content": "beep"}])


def test_template_helpers():
    template = ("{{ bos_token }}{% for m in messages %}{{ m['content'] | tojson }}{% if loop.last %}"
                "{% break %}{% endif %}{% endfor %}{% generation %}[{{ strftime_now('%Y') | length }}]"
                "{% endgeneration %}{{ tools | tojson(indent=1) if tools else '' }}{{ eos_token }}")
    out = render_chat_template(template, [{"role": "user", "content": "é\"x"}], bos_token="<s>",
                               eos_token="</s>", tools=None)
    assert out == '<s>"é\\"x"[4]</s>'


def test_template_is_sandboxed():
    with pytest.raises(BadInputError, match="chat template"):
        render_chat_template("{{ messages.__class__.__mro__[1].__subclasses__() }}", [])


def test_template_syntax_error():
    with pytest.raises(BadInputError, match="does not parse"):
        render_chat_template("{% for %}", [])


def test_chat_template_sources(tiny_model, tmp_path):
    """chat_template.jinja wins over tokenizer_config.json; named templates pick "default"."""
    folder = tmp_path / "m"
    shutil.copytree(tiny_model("qwen3"), folder)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEF"}]
    cfg_path.write_text(json.dumps(cfg))
    assert load_tokenizer(folder).apply_chat_template([]) == "DEF"
    (folder / "chat_template.jinja").write_text("JINJA {{ messages | length }}")
    assert load_tokenizer(folder).apply_chat_template([{"role": "user", "content": "x"}]) == "JINJA 1"


def test_no_chat_template(tiny_model, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_model("qwen3"), folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(BadInputError, match="no chat template"):
        load_tokenizer(folder).apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(("arch", "flag"), [("qwen3", True), ("llama3", False)])
def test_tokenizer_json_decides_bos_like_transformers(tiny_model, tmp_path, arch, flag):
    """transformers (5.x) follows tokenizer.json's post-processor, not add_bos_token in the config."""
    from transformers import AutoTokenizer

    folder = tmp_path / "m"
    shutil.copytree(tiny_model(arch), folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = flag
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours, hf = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert ours.add_bos == (arch == "llama3")
    assert ours.encode("Hi there", add_special_tokens=True) == hf("Hi there")["input_ids"]
