"""Hugging Face model folders: config.json -> ModelConfig, safetensors -> canonical weights, tokenizer.

Weights are read with safetensors' memory-mapped `safe_open`, one tensor at a time, and kept at the
precision stored (nothing is converted, so peak memory is the model's size once). Single files and
sharded checkpoints (`model.safetensors.index.json`) are both read. Names are translated from the
transformers layout (`model.layers.3.self_attn.q_proj.weight`) to the engine's (`layers.3.q.weight`).
Mixture-of-experts checkpoints (qwen3_moe, mixtral) store one tensor per expert and matrix
(`mlp.experts.5.gate_proj.weight`, mixtral's `block_sparse_moe.experts.5.w1.weight`), which map to
`layers.3.experts.5.gate.weight`; the stacked layout transformers 5 uses in memory
(`mlp.experts.gate_up_proj` [E, 2f, h], `mlp.experts.down_proj` [E, h, f]) is split per expert.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from engine.config import MOE_ARCHS, SUPPORTED_ARCHS, ModelConfig, weight_names, weight_shapes
from engine.errors import ModelLoadError, UnsupportedModelError
from engine.loading.tokenizer import ChatTokenizer

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "q.weight", "self_attn.k_proj.weight": "k.weight",
    "self_attn.v_proj.weight": "v.weight", "self_attn.o_proj.weight": "o.weight",
    "self_attn.q_proj.bias": "q.bias", "self_attn.k_proj.bias": "k.bias", "self_attn.v_proj.bias": "v.bias",
    "self_attn.q_norm.weight": "q_norm.weight", "self_attn.k_norm.weight": "k_norm.weight",
    "mlp.gate_proj.weight": "gate.weight", "mlp.up_proj.weight": "up.weight",
    "mlp.down_proj.weight": "down.weight",
}
_TOP_NAMES = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
              "lm_head.weight": "head.weight"}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^(mlp\.experts\.\d+\.(?:gate|up|down)_proj|block_sparse_moe\.experts\.\d+\.w[123])"
                        r"\.weight$")
_EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up",
                 "w2": "down"}
_ROUTERS = ("mlp.gate.weight", "block_sparse_moe.gate.weight")
_STACKED_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
_DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16",
           "half": "float16", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def canonical_name(hf_name: str) -> str | None:
    """The engine's name for a transformers tensor name; None when it is not one we know."""
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    m = _LAYER_RE.match(hf_name)
    if m is None:
        return None
    if m.group(2) in _LAYER_NAMES:
        return f"layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    if m.group(2) in _ROUTERS:
        return f"layers.{m.group(1)}.router.weight"
    if _EXPERT_RE.match(m.group(2)):
        _, _, expert, part, _ = m.group(2).split(".")
        return f"layers.{m.group(1)}.experts.{expert}.{_EXPERT_PARTS[part]}.weight"
    return None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def _field(cfg: dict, key: str, kind: type, where: Path, default=...):
    value = cfg.get(key)
    if value is None:
        if default is ...:
            raise ModelLoadError(f"{where}: required field '{key}' is missing")
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
        raise ModelLoadError(f"{where}: field '{key}' = {value!r} is not a {kind.__name__}")
    if kind is int and value <= 0:
        raise ModelLoadError(f"{where}: field '{key}' = {value} must be positive")
    return value


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def read_hf_config(folder: Path) -> ModelConfig:
    """Translate config.json (and generation_config.json) into a ModelConfig; reads no weights."""
    path = folder / "config.json"
    raw = _read_json(path)
    arch = raw.get("model_type")
    if arch is None:
        raise ModelLoadError(f"{path}: required field 'model_type' is missing")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(
            f"{path}: model_type '{arch}' is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")
    hidden = _field(raw, "hidden_size", int, path)
    heads = _field(raw, "num_attention_heads", int, path)
    head_dim = _field(raw, "head_dim", int, path, default=None) or hidden // heads
    rope_params = dict(raw.get("rope_parameters") or {})
    rope_theta = _field(raw, "rope_theta", float, path, default=None) or rope_params.pop("rope_theta", None)
    rope_params.pop("rope_theta", None)
    scaling = dict(raw.get("rope_scaling") or rope_params)
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    if scaling.get("rope_type", "default") == "default":
        scaling = {}
    window = raw.get("sliding_window")
    if arch in ("qwen2", "qwen3", "qwen3_moe") and not raw.get("use_sliding_window", False):
        window = None
    gen = _read_json(folder / "generation_config.json") if (folder / "generation_config.json").is_file() else {}
    eos = list(dict.fromkeys(_ids(raw.get("eos_token_id")) + _ids(gen.get("eos_token_id"))))
    bos = raw.get("bos_token_id", gen.get("bos_token_id"))
    dtype_name = raw.get("dtype") or raw.get("torch_dtype") or _stored_dtype(folder)
    if dtype_name not in _DTYPES:
        raise UnsupportedModelError(f"{path}: dtype '{dtype_name}' is not supported "
                                    "(expected float32, bfloat16 or float16)")
    return ModelConfig(
        arch=arch,
        vocab_size=_field(raw, "vocab_size", int, path),
        hidden_size=hidden,
        intermediate_size=_field(raw, "intermediate_size", int, path),
        num_layers=_field(raw, "num_hidden_layers", int, path),
        num_heads=heads,
        num_kv_heads=_field(raw, "num_key_value_heads", int, path, default=heads),
        head_dim=head_dim,
        rms_norm_eps=_field(raw, "rms_norm_eps", float, path, default=1e-6),
        rope_theta=float(rope_theta or 10000.0),
        rope_scaling=tuple(sorted(scaling.items())) or None,
        max_position_embeddings=_field(raw, "max_position_embeddings", int, path, default=4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        sliding_window=int(window) if window else None,
        dtype=_DTYPES[dtype_name],
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=tuple(eos),
        **(_moe_fields(raw, arch, path) if arch in MOE_ARCHS else {}),
    )


def _moe_fields(raw: dict, arch: str, path: Path) -> dict:
    """The mixture-of-experts fields of a qwen3_moe or mixtral config.json."""
    key = "num_experts" if arch == "qwen3_moe" and raw.get("num_experts") is not None else "num_local_experts"
    experts = _field(raw, key, int, path)
    top_k = _field(raw, "num_experts_per_tok", int, path)
    if top_k > experts:
        raise ModelLoadError(f"{path}: field 'num_experts_per_tok' = {top_k} is more than the {experts} experts")
    if arch == "mixtral":
        return {"num_experts": experts, "num_experts_per_tok": top_k, "norm_topk_prob": True,
                "moe_intermediate_size": _field(raw, "intermediate_size", int, path)}
    only = raw.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ModelLoadError(f"{path}: field 'mlp_only_layers' = {only!r} is not a list of layer numbers")
    return {"num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": _field(raw, "moe_intermediate_size", int, path),
            "norm_topk_prob": _field(raw, "norm_topk_prob", bool, path, default=False),
            "decoder_sparse_step": _field(raw, "decoder_sparse_step", int, path, default=1),
            "mlp_only_layers": tuple(sorted(set(only)))}


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's files: the shards an index names, else the folder's *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: field 'weight_map' is missing or empty")
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{f}: shard named in {index.name} is missing")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights (pytorch .bin files are not supported)")
    return files


def _open(file: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="pt")
    except Exception as exc:  # SafetensorError, OSError: a truncated or corrupt file
        raise ModelLoadError(f"{file}: truncated or corrupt safetensors file ({exc})") from exc


def _stored_dtype(folder: Path) -> str:
    """The dtype of the largest-named tensor's header entry, for configs that do not say it."""
    try:
        files = safetensors_files(folder)
    except ModelLoadError:
        return "float32"
    with _open(files[0]) as f:
        keys = list(f.keys())
        return f.get_slice(keys[0]).get_dtype() if keys else "F32"


def load_hf_weights(folder: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """All weights under canonical names, at the stored precision; checks names and shapes."""
    expected = {n for group in weight_names(cfg).values() for n in group}
    weights: dict[str, torch.Tensor] = {}
    for file in safetensors_files(folder):
        with _open(file) as f:
            for hf_name in list(f.keys()):
                if _STACKED_RE.match(hf_name) and cfg.is_moe:
                    weights.update(_split_stacked(f, hf_name, file, cfg))
                    continue
                name = canonical_name(hf_name)
                if name == "head.weight" and cfg.tie_word_embeddings:
                    continue  # a tied checkpoint may still store the head; the embedding is the head
                if name is None or name not in expected:
                    if _IGNORED.search(hf_name):
                        continue
                    raise UnsupportedModelError(f"{file}: tensor '{hf_name}' is not part of a "
                                                f"{cfg.arch} model as configured in config.json")
                try:
                    weights[name] = f.get_tensor(hf_name)
                except Exception as exc:
                    raise ModelLoadError(f"{file}: tensor '{hf_name}' cannot be read ({exc})") from exc
    missing = sorted(expected - weights.keys())
    if missing:
        raise ModelLoadError(f"{folder}: {len(missing)} weights missing, e.g. '{missing[0]}'")
    check_shapes(weights, cfg, str(folder))
    return weights


def _split_stacked(f, hf_name: str, file: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """transformers 5's stacked experts of one layer -> one canonical tensor per expert and matrix."""
    layer, kind = _STACKED_RE.match(hf_name).groups()
    if not cfg.is_moe_layer(int(layer)):
        raise UnsupportedModelError(f"{file}: tensor '{hf_name}' is not part of a {cfg.arch} model as "
                                    f"configured in config.json (layer {layer} has no experts)")
    try:
        t = f.get_tensor(hf_name)
    except Exception as exc:
        raise ModelLoadError(f"{file}: tensor '{hf_name}' cannot be read ({exc})") from exc
    e, fi, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    want = (e, 2 * fi, h) if kind == "gate_up_proj" else (e, h, fi)
    if tuple(t.shape) != want:
        raise ModelLoadError(f"{file}: tensor '{hf_name}' has shape {tuple(t.shape)}, config says {want}")
    p = f"layers.{layer}.experts."
    if kind == "down_proj":
        return {f"{p}{i}.down.weight": t[i] for i in range(e)}
    out = {f"{p}{i}.gate.weight": t[i, :fi] for i in range(e)}
    out.update({f"{p}{i}.up.weight": t[i, fi:] for i in range(e)})
    return out


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape every canonical weight must have under `cfg`."""
    return weight_shapes(cfg)


def check_shapes(weights: dict[str, torch.Tensor], cfg: ModelConfig, source: str) -> None:
    shapes = expected_shapes(cfg)
    for name, t in weights.items():
        if tuple(t.shape) != shapes[name]:
            raise ModelLoadError(f"{source}: weight '{name}' has shape {tuple(t.shape)}, "
                                 f"config says {shapes[name]}")


def _token_str(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(folder: Path, tok_cfg: dict) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tok_cfg.get("chat_template")
    if template is None and (folder / "chat_template.json").is_file():
        template = _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def load_hf_tokenizer(folder: Path, cfg: ModelConfig) -> ChatTokenizer:
    """tokenizer.json + tokenizer_config.json (special tokens, chat template)."""
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder}: no tokenizer.json (only 'fast' tokenizers are supported)")
    try:
        backend = Tokenizer.from_file(str(path))
    except Exception as exc:
        raise ModelLoadError(f"{path}: not a readable tokenizers file ({exc})") from exc
    tok_cfg = _read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    if (folder / "special_tokens_map.json").is_file():
        tok_cfg = {**_read_json(folder / "special_tokens_map.json"), **tok_cfg}
    specials = {k: _token_str(tok_cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    # BOS/EOS come from tokenizer.json's post-processor, as in transformers (which ignores the
    # add_bos_token/add_eos_token flags of tokenizer_config.json for tokenizer.json-backed tokenizers).
    return ChatTokenizer(
        backend, bos_token=specials["bos_token"], eos_token=specials["eos_token"],
        eos_token_ids=set(cfg.eos_token_ids), chat_template=_chat_template(folder, tok_cfg),
        special_tokens=specials, name=folder.name)
