"""GGUF files with 16-bit weights (F16, BF16) and files mixing types, through the torch engine.

llama.cpp's converter writes the matrices in the file's type but keeps norms, biases and MoE routers in
F32; a quantized file may carry F16 tensors (an embedding or head left unquantized). The loader keeps each
weight at its stored precision (16-bit tensors of another type than the compute dtype are widened to
float32, which holds them exactly) and the blocks run wider weights at their own precision.

Scores are compared per position (max |got - ref| over the vocabulary / max |ref|) with transformers'
float32 logits. The bound is the one transformers' own run in the file's dtype meets: at the median, the
90th percentile and the worst position the engine may be at most 1.5 times as far off. In BF16 a few
positions of a mixture of experts route a token to another expert (near-tied router logits) in both
runs, hence the worst position's larger error there.
"""

from __future__ import annotations

import os

import pytest
import torch

import engine
from engine.backends.torch_engine import TorchEngine
from engine.loading import load_model
from engine.models import dense
from tests.engine.reference import rel_err, transformers_logits
from tests.engine.tiny_plans import TIERS, slow_cpu_profile, third_of_weights
from tests.tiny_models import make_tiny_gguf

DEVICE = os.environ.get("SLIPSTREAM_TEST_DEVICE", "sim")
IDS = [(7 * i + 3) % 300 + 5 for i in range(90)]
DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16}
QUANTILES = torch.tensor([0.5, 0.9, 1.0])


@pytest.fixture(scope="module")
def gguf_of(tiny_model, tmp_path_factory):
    made: dict = {}

    def make(arch: str, qtype: str, types: dict[str, str] | None = None):
        key = (arch, qtype, tuple(sorted((types or {}).items())))
        if key not in made:
            hf = tiny_model(arch)
            name = "-".join([arch, qtype, *(f"{k}={v}" for k, v in sorted((types or {}).items()))])
            made[key] = (hf, make_tiny_gguf(hf, tmp_path_factory.mktemp("gguf") / f"{name}.gguf", qtype, types))
        return made[key]

    return make


@pytest.fixture(scope="module")
def references():
    """(float32 logits, transformers' own logits in `dtype`) of a tiny HF folder, computed once."""
    made: dict = {}

    def get(hf, dtype: torch.dtype):
        if (hf, dtype) not in made:
            made[hf, dtype] = (transformers_logits(hf, IDS), transformers_logits(hf, IDS, dtype))
        return made[hf, dtype]

    return get


def position_errors(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per position: max |got - ref| over the vocabulary / max |ref|; [median, 90th percentile, worst]."""
    return ((got - ref).abs().max(-1).values / ref.abs().max()).quantile(QUANTILES)


def assert_like_transformers_16bit(got: torch.Tensor, ref: torch.Tensor, ref16: torch.Tensor, what: str):
    assert got.shape == ref.shape and got.dtype == torch.float32
    ours, theirs = position_errors(got, ref), position_errors(ref16, ref)
    assert (ours <= 1.5 * theirs).all(), f"{what}: engine {ours.tolist()} vs transformers {theirs.tolist()}"


def assert_precision_kept(loaded, dtype: torch.dtype) -> None:
    """Matrices in the file's type, norms and routers in F32 as stored: nothing narrowed."""
    assert loaded.config.dtype == str(dtype).removeprefix("torch.")
    for name, w in loaded.weights.items():
        wide = w.ndim == 1 or name.endswith("router.weight")
        assert w.dtype == (torch.float32 if wide else dtype), name


def greedy(eng, n: int = 16) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy tokens) of a short prompt."""
    prompt = eng.tokenizer.encode("a b c d e", add_special_tokens=True)
    return prompt, [e.token_id for e in eng.generate("a b c d e", max_new_tokens=n) if e.token_id is not None]


def assert_greedy_follows_scores(eng, hf) -> list[int]:
    """Greedy decoding runs, and each token is the argmax of the engine's and of transformers' (float32)
    teacher-forced logits over the same tokens (at 90% of the steps at least: 16-bit ties)."""
    prompt, toks = greedy(eng)
    assert toks and all(0 <= t < eng.config.vocab_size for t in toks)
    seq = prompt + toks
    for logits in (eng.score(seq), transformers_logits(hf, seq)):
        picks = logits.argmax(-1)[len(prompt) - 1:-1].tolist()
        assert sum(a == b for a, b in zip(picks, toks)) >= 0.9 * len(toks), (picks, toks)
    return toks


# ---- the blocks over mixed dtypes --------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_blocks_run_float32_weights_at_their_precision(dtype):
    """A float32 weight, bias or norm next to 16-bit activations: computed in float32, handed back in
    the activations' dtype."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g).to(dtype)
    w, b = torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
    for bias in (None, b):
        y = dense.linear(x, w, bias)
        assert y.dtype == dtype
        assert torch.equal(y, torch.nn.functional.linear(x.float(), w, bias).to(dtype))
    y = dense.linear(x, w.to(dtype), b)                       # 16-bit matrix, float32 bias
    assert y.dtype == dtype
    assert torch.equal(y, (torch.nn.functional.linear(x, w.to(dtype)) + b).to(dtype))
    norm = torch.rand(64, generator=g) + 0.5
    h = dense.rms_norm(x, norm, 1e-6)
    x32 = x.float()
    assert h.dtype == dtype
    assert torch.equal(h, (norm * x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype))
    # one dtype throughout: transformers' order of operations, unchanged
    assert torch.equal(dense.rms_norm(x, norm.to(dtype), 1e-6),
                       norm.to(dtype) * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype))


# ---- mixtures of experts: CPU, every forced plan, greedy ---------------------------------------

@pytest.mark.parametrize("qtype", ["F16", "BF16"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_16bit_gguf_scores_like_transformers(gguf_of, references, arch, qtype):
    hf, path = gguf_of(arch, qtype)
    ref, ref16 = references(hf, DTYPES[qtype])
    loaded = load_model(path)
    assert_precision_kept(loaded, DTYPES[qtype])
    cpu = engine.open_model(path, device="cpu", backend="torch")
    assert_like_transformers_16bit(cpu.score(IDS), ref, ref16, "cpu")
    want = assert_greedy_follows_scores(cpu, hf)
    cpu.close()

    eng = TorchEngine(loaded, tiers=TIERS, profile=slow_cpu_profile(), device=DEVICE, speculative=False)
    eng.set_vram_budget(third_of_weights(eng))
    seen = set()
    for kind in ("gpu_only", "static", "dynamic"):
        eng.force_plan(kind)
        assert_like_transformers_16bit(eng.score(IDS), ref, ref16, kind)
        report = eng.plan_report()
        assert kind in {t["plan"] for t in report["tiers"]}
        seen |= {p for t in report["tiers"] for n, p in t["placement"].items() if ".experts." in n or
                 n.endswith(".ffn")}
        toks = assert_greedy_follows_scores(eng, hf)
        if DEVICE == "sim":                       # the same arithmetic as the CPU run
            assert toks == want, kind
    assert seen == {"resident", "streamed", "cpu"}        # routers and expert groups ran in every placement
    eng.close()


# ---- dense models: the same files' norms and biases ----------------------------------------------

@pytest.mark.parametrize("qtype", ["F16", "BF16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])     # permuted Q/K; F32 q/k/v biases; q/k norms
def test_dense_16bit_gguf_scores_like_transformers(gguf_of, references, arch, qtype):
    hf, path = gguf_of(arch, qtype)
    ref, ref16 = references(hf, DTYPES[qtype])
    cpu = engine.open_model(path, device="cpu", backend="torch")
    assert_like_transformers_16bit(cpu.score(IDS), ref, ref16, "cpu")
    cpu.close()


# ---- files mixing types ------------------------------------------------------------------------

def transformers_logits_of(hf, weights: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """Float32 logits of transformers' model of the folder `hf` run on `weights` (the engine's names)."""
    import re

    from transformers import AutoModelForCausalLM

    from engine.loading.hf import canonical_name

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        for key, param in model.state_dict().items():
            m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj", key)
            if m is None:
                param.copy_(weights[canonical_name(key)])
                continue
            parts = ("gate", "up") if m.group(2) == "gate_up" else ("down",)
            param.copy_(torch.stack([torch.cat([weights[f"layers.{m.group(1)}.experts.{e}.{p}.weight"]
                                                for p in parts]) for e in range(param.shape[0])]))
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize(("arch", "qtype", "other"), [
    ("llama", "Q8_0", "F16"), ("qwen3_moe", "Q8_0", "F16"), ("mixtral", "BF16", "F16"), ("qwen3_moe", "F16", "F32")])
def test_tensors_of_another_type_keep_their_precision(gguf_of, references, arch, qtype, other):
    """Embedding and head of another type than the file's matrices: F16 in a Q8_0 file (float32
    compute) or a BF16 file, widened to float32 (which holds them exactly); F32 in an F16 file, kept. The
    model runs: a Q8_0 file as transformers does on the weights it holds, a 16-bit one within the bound
    transformers' own 16-bit run meets."""
    hf, path = gguf_of(arch, qtype, {"token_embd.weight": other, "output.weight": other})
    loaded, reference = load_model(path), load_model(hf)
    compute = {"Q8_0": "float32", "F16": "float16", "BF16": "bfloat16"}[qtype]
    assert loaded.config.dtype == compute
    for name in ("embed.weight", "head.weight"):
        got = loaded.weights[name]
        want = reference.weights[name].to(DTYPES.get(other, torch.float32)).float()
        assert got.dtype == torch.float32 and torch.equal(got, want), name
    cpu = engine.open_model(path, device="cpu", backend="torch")
    got = cpu.score(IDS)
    cpu.close()
    if qtype == "Q8_0":
        assert rel_err(got, transformers_logits_of(hf, loaded.weights, IDS)) < 1e-5
    else:
        assert_like_transformers_16bit(got, *references(hf, DTYPES[qtype]), "cpu")


@pytest.mark.parametrize("arch", ["qwen3_moe", "llama"])
def test_planned_bytes_equal_the_packed_bytes(gguf_of, arch):
    """The planner's bytes of every sub-layer are what the executor packs and books, with the file's
    float32 norms and routers beside its 16-bit matrices; a plan filling the budget activates."""
    from engine.backends.torch_engine import TorchEngine
    from engine.sharding.memory import sublayer_bytes

    _, path = gguf_of(arch, "F16")
    eng = TorchEngine(str(path), device="sim", vram_budget="1GiB", speculative=False)
    assert eng.spec.wide                                   # norms (and routers) kept in float32
    planned = sublayer_bytes(eng.spec)
    assert planned == {s.name: eng.executor.store.nbytes(s.name) for s in eng.spec.sublayers}
    tight = eng.plan_report()["tiers"][0]["vram"]["total"]
    eng.set_vram_budget(tight)
    eng.force_plan("gpu_only")
    assert eng.score(IDS[:20]).shape[0] == 20
    eng.close()
