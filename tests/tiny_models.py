"""Tiny random-weight Hugging Face model folders for tests, built offline.

`make_tiny_model(arch, path, **overrides)` writes a complete HF folder (config.json,
generation_config.json, model.safetensors or shards + index, tokenizer.json, tokenizer_config.json with
a chat template) that `AutoModelForCausalLM` and `AutoTokenizer` load without the network. The
tokenizer is a real byte-level BPE trained in-process on `TRAINING_TEXT`. Everything is seeded, so the
same call gives the same weights. `tiny_model_cache()` builds each variant once per process.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path

ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")

BOS, EOS, IM_START, IM_END, PAD = "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|pad|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END, PAD]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] | trim + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A gamer starts a new match and the video card fills up;
the assistant in the tray notices, moves a few layers to the processor, and keeps answering questions.
When the game ends, the memory comes back and everything gets faster again. Models are made of layers,
and each layer has an attention block and a feed-forward block. Weights can be resident, streamed or
computed on the CPU. Numbers like 12, 345, 6789 and 3.14159 appear in text, as do dates: 2024-05-17.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? It is Paris.
def main():\n    print("hello")\n    return 0\nCode has indentation, brackets [like these], braces {x: 1}.
She sells sea shells by the sea shore. Peter Piper picked a peck of pickled peppers.
Once upon a time, in a land far away, there lived a small robot who loved to read books about the stars.
Temperature, top_p and stop strings shape how a model samples its next token from the distribution.
"""

_BASE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,      # GQA by default; pass num_key_value_heads=4 for MHA
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "initializer_range": 0.1,      # larger than HF's 0.02 so logits are well apart (greedy is stable)
}

_ARCH_DEFAULTS: dict[str, dict] = {
    "llama": {},
    "llama3": {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}},
    "mistral": {"sliding_window": None},
    "qwen2": {"rope_theta": 1000000.0, "tie_word_embeddings": True},
    "qwen3": {"rope_theta": 1000000.0, "attention_bias": False},
    # Mixtures of experts: 8 experts, top-2 (qwen3_moe's experts narrower than its dense FFN width).
    "qwen3_moe": {"rope_theta": 1000000.0, "attention_bias": False, "num_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "norm_topk_prob": True, "decoder_sparse_step": 1,
                  "mlp_only_layers": []},
    "mixtral": {"rope_theta": 1000000.0, "num_local_experts": 8, "num_experts_per_tok": 2,
                "intermediate_size": 64, "sliding_window": None},
}


UNK = "<unk>"
_BYTE_SPLITS = {  # the pre-tokenizer regexes of Llama-3 and Qwen2 (tokenizer.json data)
    "llama3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}
# Tokenizer style per arch, as the real families ship them: Llama-2/Mistral SentencePiece-style BPE,
# Llama-3 byte-level BPE, Qwen2 byte-level BPE with NFC.
TOKENIZER_STYLE = {"llama": "spm", "mistral": "spm", "llama3": "llama3", "qwen2": "qwen2", "qwen3": "qwen2",
                   "qwen3_moe": "qwen2", "mixtral": "spm"}


def build_tokenizer(style: str = "llama3", add_bos: bool = True):
    """A real `tokenizers.Tokenizer` trained on TRAINING_TEXT (deterministic): "spm" (▁ + byte
    fallback, 512 tokens), "llama3" or "qwen2" (byte-level, 384 tokens)."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    if style == "spm":
        tok = _build_spm()
    else:
        tok = Tokenizer(models.BPE(ignore_merges=style == "llama3"))
        if style == "qwen2":
            tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_BYTE_SPLITS[style]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator([TRAINING_TEXT] * 3, trainer=trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _build_spm():
    """SentencePiece-style BPE like Llama-2's tokenizer.json: pieces ranked by score, merges for every
    split of a piece into two pieces, "▁" for spaces, a space prefix, and <0xNN> byte fallback."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    from engine.loading.gguf_tokenizer import spm_merges

    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    learner.train_from_iterator([TRAINING_TEXT] * 3, trainer=trainers.BpeTrainer(
        vocab_size=250, show_progress=False))
    pieces = [t for t, _ in sorted(learner.get_vocab().items(), key=lambda kv: kv[1])]
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    tokens = [UNK, *SPECIAL_TOKENS, *byte_tokens, *pieces]
    scores = [0.0] * (1 + len(SPECIAL_TOKENS) + 256) + [-float(i) for i in range(len(pieces))]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, spm_merges(tokens, scores), unk_token=UNK, fuse_unk=True,
                               byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in [UNK, *SPECIAL_TOKENS]])
    return tok


def _write_tokenizer(folder: Path, style: str, add_bos: bool) -> dict[str, int]:
    tok = build_tokenizer(style, add_bos=add_bos)
    tok.save(str(folder / "tokenizer.json"))
    unk = UNK if style == "spm" else None
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": unk,
        "clean_up_tokenization_spaces": False,
        "model_max_length": _BASE["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (folder / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": unk}, indent=2))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    ids["vocab_size"] = tok.get_vocab_size()
    return ids


def _perturb_(model, seed: int) -> None:
    """Give norms and biases random values too, so a swapped or missing weight shows in every test."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def make_tiny_model(arch: str, path: str | Path, *, seed: int = 0, dtype: str = "float32",
                    max_shard_size: str | None = None, **config_overrides) -> Path:
    """Write a tiny random HF model folder of `arch` (see ARCHS) into `path`; returns the path.

    config_overrides go into the transformers config (e.g. tie_word_embeddings=True,
    num_key_value_heads=4 for MHA, num_hidden_layers=4). `dtype` ("float32" | "bfloat16" | "float16")
    is the precision saved; `max_shard_size` (e.g. "20KB") writes sharded safetensors with an index.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    if arch == "qwen2_5_vl":   # the vision-language builder (not in ARCHS: the text-only tests loop over those)
        return make_tiny_qwen2_5_vl(path, seed=seed, dtype=dtype, **config_overrides)
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; expected one of {ARCHS}")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    add_bos = arch in ("llama", "llama3", "mistral", "mixtral")
    ids = _write_tokenizer(folder, TOKENIZER_STYLE[arch], add_bos=add_bos)

    kwargs = {**_BASE, **_ARCH_DEFAULTS[arch], **config_overrides}
    if arch == "qwen2":
        kwargs.pop("attention_bias", None)  # qwen2 always has q/k/v biases
    kwargs.setdefault("vocab_size", ids["vocab_size"])
    kwargs.update(bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD])
    model_type = "llama" if arch == "llama3" else arch
    config = AutoConfig.for_model(model_type, **kwargs)

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_(model, seed)
    model = model.to(getattr(torch, dtype)).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=ids[BOS], eos_token_id=[ids[EOS], ids[IM_END]], pad_token_id=ids[PAD])
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **save_kwargs)
    if not any(folder.glob("*.safetensors")):
        raise RuntimeError(f"transformers did not write safetensors into {folder}")
    return folder


_cache_root: Path | None = None
_cache: dict[tuple, Path] = {}


def tiny_model_cache(arch: str, **options) -> Path:
    """make_tiny_model, built once per process (per arch + options) under a temporary folder."""
    global _cache_root
    key = (arch, tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in options.items())))
    if key not in _cache:
        if _cache_root is None:
            _cache_root = Path(tempfile.mkdtemp(prefix="slipstream-tiny-"))
            atexit.register(shutil.rmtree, _cache_root, ignore_errors=True)
        _cache[key] = make_tiny_model(arch, _cache_root / f"m{len(_cache)}-{arch}", **options)
    return _cache[key]


# ---- GGUF files written from tiny HF folders (what llama.cpp's converter would write) -------------

_GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
             "mixtral": "llama"}
_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
}
# Experts, stacked per layer as llama.cpp's converter writes them: HF part name -> GGUF tensor.
_GGUF_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                 "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
_GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def _stack_experts(tensors: dict) -> dict:
    """Per-expert HF tensors -> one stacked [E, rows, cols] tensor per layer and part (GGUF names)."""
    import re

    import torch

    out, stacks = {}, {}
    for name, t in tensors.items():
        m = re.match(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$", name)
        if m is None:
            out[name] = t
        else:
            stacks.setdefault(f"blk.{m.group(1)}.{_GGUF_EXPERTS[m.group(3)]}.weight", {})[int(m.group(2))] = t
    for name, parts in stacks.items():
        out[name] = torch.stack([parts[e] for e in sorted(parts)])
    return out


def _gguf_name(hf: str) -> str:
    if hf.startswith("blk."):
        return hf
    if hf in _GGUF_TOP:
        return _GGUF_TOP[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_GGUF_LAYER[rest]}"


def _converter_permute(w, n_head: int):
    """llama.cpp's convert_hf_to_gguf Q/K row permutation (rotate-half -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_freqs(cfg: dict):
    import math

    import numpy as np

    rp = cfg.get("rope_parameters") or {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg["rope_theta"]}
    dim = cfg["head_dim"]
    old, low, high, factor = (rp["original_max_position_embeddings"], rp["low_freq_factor"],
                              rp["high_freq_factor"], rp["factor"])
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * rp["rope_theta"] ** (i / dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _tokenizer_fields(folder: Path) -> dict:
    """GGUF tokenizer metadata for a tiny folder's tokenizer.json (as the converter writes it)."""
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = dict(data["model"]["vocab"])
    added = {t["content"]: t for t in data["added_tokens"]}
    for t in added.values():
        vocab[t["content"]] = t["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [3 if t in added and added[t]["special"] else 1 for t in tokens]
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    fields = {"tokens": tokens, "types": types, "chat_template": cfg["chat_template"]}
    if data["model"].get("byte_fallback"):   # SentencePiece style: scores as _build_spm gave them
        n_fixed = 1 + len(SPECIAL_TOKENS) + 256
        fields.update(model="llama", scores=[0.0] * n_fixed + [-float(i) for i in range(len(tokens) - n_fixed)])
        fields["types"] = [2 if t == UNK else 6 if t.startswith("<0x") and len(t) == 6 else k
                           for t, k in zip(tokens, types)]
    else:
        merges = data["model"]["merges"]
        fields.update(model="gpt2", merges=[m if isinstance(m, str) else " ".join(m) for m in merges],
                      pre="qwen2" if data.get("normalizer") else "llama-bpe")
    return fields


def make_tiny_gguf(hf_folder: str | Path, path: str | Path, qtype: str = "F32",
                   types: dict[str, str] | None = None) -> Path:
    """Write the tiny HF model at `hf_folder` as a GGUF file, the way llama.cpp's converter does
    (llama-family Q/K rows permuted, llama3 scaling as rope_freqs.weight, tied head omitted).
    `qtype` is the type of the 2-D weights: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0 (norms stay F32);
    `types` gives single tensors (by GGUF name, e.g. "token_embd.weight") another type."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    hf_folder, path = Path(hf_folder), Path(path)
    cfg = json.loads((hf_folder / "config.json").read_text())
    arch = _GGUF_ARCH[cfg["model_type"]]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(hf_folder.name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if arch == "qwen3moe":
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rp = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType[f"MOSTLY_{qtype}" if qtype != "F32" else "ALL_F32"])
    tok = _tokenizer_fields(hf_folder)
    w.add_tokenizer_model(tok["model"])
    if "pre" in tok:
        w.add_tokenizer_pre(tok["pre"])
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    if "scores" in tok:
        w.add_token_scores(tok["scores"])
    if "merges" in tok:
        w.add_token_merges(tok["merges"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    if tok["model"] == "llama":
        w.add_unk_token_id(tok["tokens"].index(UNK))
    w.add_add_bos_token(arch == "llama")
    w.add_add_eos_token(False)
    w.add_chat_template(tok["chat_template"])

    tensors = {}
    for f in sorted(hf_folder.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    if ((cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}).get("rope_type")) == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_freqs(cfg))
    tensors = _stack_experts(tensors)
    for name, t in tensors.items():
        arr = t.float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            arr = _converter_permute(arr, heads)
        router = name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight"))   # kept F32, as the converter does
        kind = (types or {}).get(_gguf_name(name), qtype if arr.ndim >= 2 and not router else "F32")
        if kind != "F32":
            q = gguf.GGMLQuantizationType[kind]
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(arr, q), raw_dtype=q)
        else:
            w.add_tensor(_gguf_name(name), np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- Qwen2.5-VL (vision-language): a tiny random model + processor config -------------------------

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
VL_SPECIAL_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]

# Qwen2.5-VL's chat template, reduced to what the tests need: string contents, or lists of
# {"type": "text"} / {"type": "image"} parts (an image part renders as vision_start, image_pad, vision_end).
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The vision tower: 3 blocks (block 1 full attention, 0 and 2 windowed), hidden 32 over 2 heads,
# patch 14, merge 2; window_size 56 px = 2x2 merged tokens (4x4 patches), so every test image is split
# into several windows. The processor keeps images between 56x56 and ~224x224 pixels (fast tests).
VL_VISION = {"depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 14,
             "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1],
             "in_channels": 3, "tokens_per_second": 2, "hidden_act": "silu"}
VL_MIN_PIXELS, VL_MAX_PIXELS = 56 * 56, 28 * 28 * 64


def make_tiny_qwen2_5_vl(path: str | Path, *, seed: int = 0, dtype: str = "float32", vision: dict | None = None,
                         min_pixels: int = VL_MIN_PIXELS, max_pixels: int = VL_MAX_PIXELS,
                         **text_overrides) -> Path:
    """Write a tiny random Qwen2.5-VL folder (Qwen2_5_VLForConditionalGeneration.save_pretrained, a
    byte-level BPE tokenizer with the vision special tokens, a chat template that places image parts,
    preprocessor_config.json with small min/max pixels) into `path`; returns the path."""
    import torch
    from tokenizers import AddedToken
    from transformers import GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer("qwen2", add_bos=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VL_SPECIAL_TOKENS])
    tok.save(str(folder / "tokenizer.json"))
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": IM_END,
               "pad_token": PAD, "unk_token": None, "clean_up_tokenization_spaces": False,
               "model_max_length": 1024, "chat_template": VL_CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS + VL_SPECIAL_TOKENS}
    vocab = tok.get_vocab_size()

    text = {"vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
            "rms_norm_eps": 1e-6, "initializer_range": 0.1, "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
            "bos_token_id": ids[BOS], "eos_token_id": ids[IM_END], "pad_token_id": ids[PAD]}
    text.update(text_overrides)
    vis = {**VL_VISION, "out_hidden_size": text["hidden_size"], "initializer_range": 0.1, **(vision or {})}
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vis, image_token_id=ids[IMAGE_PAD],
                              video_token_id=ids[VIDEO_PAD], vision_start_token_id=ids[VISION_START],
                              vision_end_token_id=ids[VISION_END], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    _perturb_(model, seed)
    model = model.to(getattr(torch, dtype)).eval()
    model.generation_config = GenerationConfig(bos_token_id=ids[BOS], eos_token_id=[ids[IM_END]],
                                               pad_token_id=ids[PAD])
    model.save_pretrained(folder)
    pre = {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": min_pixels, "max_pixels": max_pixels,
           "patch_size": vis["patch_size"], "temporal_patch_size": vis["temporal_patch_size"],
           "merge_size": vis["spatial_merge_size"], "do_convert_rgb": True, "do_rescale": True,
           "rescale_factor": 1 / 255, "do_normalize": True, "resample": 3,
           "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}
    (folder / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    return folder
