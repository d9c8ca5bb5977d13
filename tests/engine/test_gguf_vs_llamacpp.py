"""The bundled GGUF through the torch backend agrees with llama.cpp on the same file.

torch dequantizes the Q4_1/Q8_0 weights to float32 and computes in float32; llama.cpp computes with the
quantized weights (and 8-bit quantized activations in its dot products), so the logits differ slightly:
the next-token choices must agree and the distributions must be close (KL measured per position).
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("llama_cpp") is None:
    pytest.skip("llama-cpp-python is not installed", allow_module_level=True)
import torch

import engine.backends.llamacpp  # noqa: F401  (first: sets llama.cpp's thread wait policy before it loads)

pytestmark = [pytest.mark.llamacpp, pytest.mark.slow]

# Plain English prose (written for this test), long enough for ~200 tokens.
PARAGRAPH = (
    "When the first railways crossed the country, towns that had been a week apart by coach found "
    "themselves a morning's ride from each other. Farmers could send milk to the city before it soured, "
    "newspapers printed in the capital were read in distant villages the same evening, and clocks, which "
    "had kept local time set by the sun, were slowly brought into line so that timetables would make "
    "sense. Not everyone welcomed the change. Some landowners refused to let the lines cross their "
    "fields, and coaching inns along the old roads lost their trade within a few years. Yet the stations "
    "became places where people met, argued and waited, and the sound of the evening train was soon as "
    "familiar as the church bell. Historians still debate whether the railways created the growth that "
    "followed or merely sped up changes that were already under way, but few doubt that ordinary life, "
    "from the food on the table to the hour at which people went to bed, was different afterwards."
)

# Measured on the bundled SmolLM2-135M Q4_1 over PARAGRAPH (191 tokens): top-1 agreement 0.958, mean KL
# 0.0035, max KL 0.014. The bounds leave room for other CPUs' kernels.
MIN_TOP1 = 0.9
MAX_MEAN_KL = 0.02


@pytest.fixture(scope="module")
def engines():
    import engine

    lc = engine.open_model(None, backend="llamacpp", device="cpu", n_threads=1)
    try:
        tt = engine.open_model(None, backend="torch", device="cpu")
    except (ImportError, NotImplementedError) as exc:   # the torch backend is not there yet
        lc.close()
        pytest.fail(f"the torch backend cannot open the bundled GGUF: {exc}")
    yield lc, tt
    tt.close()
    lc.close()


def paragraph_ids(eng) -> list[int]:
    tok = eng.tokenizer
    ids = tok.encode(PARAGRAPH)
    return [tok.bos_token_id] + ids if tok.add_bos and tok.bos_token_id is not None else ids


def agreement(lc_logits: torch.Tensor, torch_logits: torch.Tensor) -> tuple[float, float, float]:
    """(top-1 agreement, mean KL(llama.cpp || torch), max KL) over positions."""
    a, b = lc_logits.double(), torch_logits.double()
    top1 = (a.argmax(-1) == b.argmax(-1)).double().mean().item()
    la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    kl = (la.exp() * (la - lb)).sum(-1)
    return top1, kl.mean().item(), kl.max().item()


def test_tokenizers_agree(engines):
    lc, tt = engines
    assert paragraph_ids(tt) == paragraph_ids(lc)
    msgs = [{"role": "user", "content": "What is a railway?"}]
    assert tt.encode_prompt(msgs) == lc.encode_prompt(msgs)


def test_teacher_forced_logits_agree(engines, record_property):
    lc, tt = engines
    ids = paragraph_ids(lc)
    assert len(ids) >= 150
    lc_logits, torch_logits = lc.score(ids), tt.score(ids)
    assert lc_logits.shape == torch_logits.shape == (len(ids), lc.tokenizer.vocab_size)
    top1, mean_kl, max_kl = agreement(lc_logits, torch_logits)
    record_property("tokens", len(ids))
    record_property("top1_agreement", round(top1, 4))
    record_property("mean_kl", round(mean_kl, 5))
    print(f"\n{len(ids)} tokens: top-1 agreement {top1:.4f}, KL(llama.cpp||torch) mean {mean_kl:.5f} "
          f"max {max_kl:.5f}")
    assert top1 >= MIN_TOP1
    assert mean_kl < MAX_MEAN_KL


def greedy(eng, prompt: str, n: int) -> list[int]:
    return [e.token_id for e in eng.generate(prompt, max_new_tokens=n) if e.token_id is not None]


def test_greedy_continuations_agree_until_a_near_tie(engines):
    """Greedy text is the same until a step where llama.cpp itself hesitates between two tokens
    (there the small numeric differences may legitimately pick the other one)."""
    lc, tt = engines
    prompt = PARAGRAPH[:PARAGRAPH.index("Not everyone")].rstrip()
    a, b = greedy(lc, prompt, 16), greedy(tt, prompt, 16)
    ids = lc.encode_prompt(prompt)
    probs = torch.softmax(lc.score(ids + a)[len(ids) - 1:].double(), -1)
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            top2 = probs[k].topk(2).values
            assert top2[0] - top2[1] < 0.05, f"step {k}: torch chose {y}, llama.cpp {x} with p={top2[0]:.3f}"
            break
