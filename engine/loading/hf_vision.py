"""Qwen2.5-VL Hugging Face folders (Cosmos-Reason1 is one): the language model as a plain "qwen2"
ModelConfig + canonical weights, the vision tower as a VisionConfig + canonical vision weights, and the
image processor settings of preprocessor_config.json.

Both checkpoint layouts are read: the one transformers writes and the hub ships
(`visual.blocks.0.attn.qkv.weight`, `model.layers.0...`, `lm_head.weight`) and transformers 5's in-memory
naming (`model.visual.*`, `model.language_model.*`). config.json may hold the text fields at the top
level (older files, `rope_scaling: {"type": "mrope", "mrope_section": [...]}`) or under `text_config`
(`rope_parameters`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.config import ModelConfig, weight_names
from engine.errors import ModelLoadError, UnsupportedModelError
from engine.loading.hf import (
    _DTYPES,
    _field,
    _ids,
    _read_json,
    canonical_name,
    check_shapes,
    load_hf_tokenizer,
    safetensors_files,
)
from engine.models.vision.qwen2_5_vl_processor import CLIP_MEAN, CLIP_STD, ImageProcessorConfig
from engine.models.vision.qwen2_5_vl_tower import VisionConfig, vision_weight_names, vision_weight_shapes

VL_ARCHS = ("qwen2_5_vl",)

_VISION_LOCAL = {
    "norm1.weight": "attn_norm.weight", "norm2.weight": "ffn_norm.weight",
    "attn.qkv.weight": "qkv.weight", "attn.qkv.bias": "qkv.bias",
    "attn.proj.weight": "o.weight", "attn.proj.bias": "o.bias",
    "mlp.gate_proj.weight": "gate.weight", "mlp.gate_proj.bias": "gate.bias",
    "mlp.up_proj.weight": "up.weight", "mlp.up_proj.bias": "up.bias",
    "mlp.down_proj.weight": "down.weight", "mlp.down_proj.bias": "down.bias",
}
_VISION_TOP = {
    "patch_embed.proj.weight": "vision.patch_embed.weight",
    "merger.ln_q.weight": "vision.merger.norm.weight",
    "merger.mlp.0.weight": "vision.merger.fc1.weight", "merger.mlp.0.bias": "vision.merger.fc1.bias",
    "merger.mlp.2.weight": "vision.merger.fc2.weight", "merger.mlp.2.bias": "vision.merger.fc2.bias",
}
_VISION_PREFIX = re.compile(r"^(?:model\.)?visual\.(.+)$")
_BLOCK_RE = re.compile(r"^blocks\.(\d+)\.(.+)$")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$|rotary_pos_emb\.inv_freq$")


def is_vl_folder(folder: Path) -> bool:
    """Is this a Hugging Face folder of a vision-language model we read (model_type qwen2_5_vl)?"""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return False
    try:
        return _read_json(path).get("model_type") in VL_ARCHS
    except ModelLoadError:
        return False


def vision_canonical_name(hf_name: str) -> str | None:
    """'visual.blocks.3.attn.qkv.weight' (or 'model.visual....') -> 'vision.blocks.3.qkv.weight'."""
    m = _VISION_PREFIX.match(hf_name)
    if m is None:
        return None
    rest = m.group(1)
    if rest in _VISION_TOP:
        return _VISION_TOP[rest]
    b = _BLOCK_RE.match(rest)
    if b and b.group(2) in _VISION_LOCAL:
        return f"vision.blocks.{b.group(1)}.{_VISION_LOCAL[b.group(2)]}"
    return None


def text_canonical_name(hf_name: str) -> str | None:
    """The language model's tensors in either layout -> the engine's canonical names."""
    if hf_name.startswith("model.language_model."):
        hf_name = "model." + hf_name[len("model.language_model."):]
    return canonical_name(hf_name)


# ---- config ---------------------------------------------------------------------------------------

def read_vl_config(folder: Path) -> tuple[ModelConfig, VisionConfig]:
    """config.json (+ generation_config.json, preprocessor_config.json) -> (the language model as a
    "qwen2" ModelConfig, the VisionConfig with its image processor settings)."""
    folder = Path(folder)
    path = folder / "config.json"
    raw = _read_json(path)
    if raw.get("model_type") not in VL_ARCHS:
        raise UnsupportedModelError(f"{path}: model_type '{raw.get('model_type')}' is not a supported "
                                    f"vision-language model (supported: {', '.join(VL_ARCHS)})")
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    tf = {**raw, **text}                       # text fields: under text_config when there is one
    vis = raw.get("vision_config")
    if not isinstance(vis, dict):
        raise ModelLoadError(f"{path}: required field 'vision_config' is missing")

    hidden = _field(tf, "hidden_size", int, path)
    heads = _field(tf, "num_attention_heads", int, path)
    rope = dict(tf.get("rope_parameters") or tf.get("rope_scaling") or {})
    theta = tf.get("rope_theta") or rope.get("rope_theta") or 1000000.0
    section = tuple(int(s) for s in (rope.get("mrope_section") or (16, 24, 24)))
    head_dim = hidden // heads
    if sum(section) != head_dim // 2:
        raise ModelLoadError(f"{path}: mrope_section {list(section)} does not sum to head_dim/2 = {head_dim // 2}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise UnsupportedModelError(f"{path}: rope type '{kind}' is not supported for {raw['model_type']}")
    gen = _read_json(folder / "generation_config.json") if (folder / "generation_config.json").is_file() else {}
    eos = list(dict.fromkeys(_ids(tf.get("eos_token_id")) + _ids(gen.get("eos_token_id"))))
    bos = tf.get("bos_token_id", gen.get("bos_token_id"))
    dtype_name = raw.get("dtype") or raw.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype") \
        or "bfloat16"
    if dtype_name not in _DTYPES:
        raise UnsupportedModelError(f"{path}: dtype '{dtype_name}' is not supported "
                                    "(expected float32, bfloat16 or float16)")
    window = tf.get("sliding_window") if tf.get("use_sliding_window", False) else None
    cfg = ModelConfig(
        arch="qwen2",
        vocab_size=_field(tf, "vocab_size", int, path),
        hidden_size=hidden,
        intermediate_size=_field(tf, "intermediate_size", int, path),
        num_layers=_field(tf, "num_hidden_layers", int, path),
        num_heads=heads,
        num_kv_heads=_field(tf, "num_key_value_heads", int, path, default=heads),
        head_dim=head_dim,
        rms_norm_eps=_field(tf, "rms_norm_eps", float, path, default=1e-6),
        rope_theta=float(theta),
        rope_scaling=None,
        max_position_embeddings=_field(tf, "max_position_embeddings", int, path, default=32768),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        attention_bias=True,
        sliding_window=int(window) if window else None,
        dtype=_DTYPES[dtype_name],
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=tuple(eos),
    )
    vpath = f"{path} vision_config"
    vrope = dict(vis.get("rope_parameters") or {})
    full = vis.get("fullatt_block_indexes") or []
    if not isinstance(full, list) or not all(isinstance(i, int) for i in full):
        raise ModelLoadError(f"{vpath}: field 'fullatt_block_indexes' = {full!r} is not a list of block numbers")
    vhidden = _field(vis, "hidden_size", int, vpath)
    vheads = _field(vis, "num_heads", int, vpath)
    if vhidden % vheads or (vhidden // vheads) % 4:
        raise ModelLoadError(f"{vpath}: hidden_size {vhidden} over {vheads} heads is not a head size divisible by 4")

    def token(key: str, default: int) -> int:
        value = raw.get(key, text.get(key, default))
        return int(value) if value is not None else default

    vcfg = VisionConfig(
        depth=_field(vis, "depth", int, vpath),
        hidden_size=vhidden,
        num_heads=vheads,
        intermediate_size=_field(vis, "intermediate_size", int, vpath),
        out_hidden_size=_field(vis, "out_hidden_size", int, vpath, default=hidden),
        patch_size=_field(vis, "patch_size", int, vpath, default=14),
        spatial_merge_size=_field(vis, "spatial_merge_size", int, vpath, default=2),
        temporal_patch_size=_field(vis, "temporal_patch_size", int, vpath, default=2),
        in_channels=int(vis.get("in_channels") or vis.get("in_chans") or 3),
        window_size=_field(vis, "window_size", int, vpath, default=112),
        fullatt_block_indexes=tuple(full),
        hidden_act=str(vis.get("hidden_act") or "silu"),
        rope_theta=float(vrope.get("rope_theta") or 10000.0),
        image_token_id=token("image_token_id", 151655),
        video_token_id=token("video_token_id", 151656),
        vision_start_token_id=token("vision_start_token_id", 151652),
        vision_end_token_id=token("vision_end_token_id", 151653),
        mrope_section=section,
        tokens_per_second=int(vis.get("tokens_per_second") or 2),
        dtype=_DTYPES[dtype_name],
    )
    if vcfg.out_hidden_size != hidden:
        raise ModelLoadError(f"{vpath}: out_hidden_size {vcfg.out_hidden_size} is not the language model's "
                             f"hidden_size {hidden}")
    return cfg, replace(vcfg, processor=read_processor_config(folder, vcfg))


def read_processor_config(folder: Path, vcfg: VisionConfig) -> ImageProcessorConfig:
    """preprocessor_config.json -> ImageProcessorConfig (the reference defaults where it is absent)."""
    path = Path(folder) / "preprocessor_config.json"
    raw = _read_json(path) if path.is_file() else {}
    size = raw.get("size") if isinstance(raw.get("size"), dict) else {}
    min_px = raw.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or 56 * 56
    max_px = raw.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or 28 * 28 * 1280
    try:
        pcfg = ImageProcessorConfig(
            min_pixels=int(min_px), max_pixels=int(max_px),
            patch_size=int(raw.get("patch_size") or vcfg.patch_size),
            temporal_patch_size=int(raw.get("temporal_patch_size") or vcfg.temporal_patch_size),
            merge_size=int(raw.get("merge_size") or vcfg.spatial_merge_size),
            image_mean=tuple(float(v) for v in (raw.get("image_mean") or CLIP_MEAN)),
            image_std=tuple(float(v) for v in (raw.get("image_std") or CLIP_STD)),
            rescale_factor=float(raw.get("rescale_factor") or 1 / 255),
            do_convert_rgb=bool(raw.get("do_convert_rgb", True)),
            do_rescale=bool(raw.get("do_rescale", True)),
            do_normalize=bool(raw.get("do_normalize", True)),
            resample=int(raw.get("resample", 3)),
        )
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path}: invalid image processor settings ({exc})") from exc
    if pcfg.min_pixels <= 0 or pcfg.max_pixels < pcfg.min_pixels:
        raise ModelLoadError(f"{path}: min_pixels {pcfg.min_pixels} / max_pixels {pcfg.max_pixels} are not a range")
    if (pcfg.patch_size, pcfg.temporal_patch_size, pcfg.merge_size) != (
            vcfg.patch_size, vcfg.temporal_patch_size, vcfg.spatial_merge_size):
        raise ModelLoadError(f"{path}: patch/merge sizes differ from config.json's vision_config")
    return pcfg


# ---- weights --------------------------------------------------------------------------------------

def _open(file: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="pt")
    except Exception as exc:  # a truncated or corrupt file
        raise ModelLoadError(f"{file}: truncated or corrupt safetensors file ({exc})") from exc


def load_vl_weights(folder: Path, cfg: ModelConfig, vcfg: VisionConfig
                    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(language model weights under engine.config's canonical names, vision weights under
    `vision_weight_names`), at the stored precision; names and shapes checked."""
    folder = Path(folder)
    expected = {n for group in weight_names(cfg).values() for n in group}
    vshapes = vision_weight_shapes(vcfg)
    text: dict[str, torch.Tensor] = {}
    vision: dict[str, torch.Tensor] = {}
    for file in safetensors_files(folder):
        with _open(file) as f:
            for hf_name in list(f.keys()):
                vname = vision_canonical_name(hf_name)
                name = None if vname else text_canonical_name(hf_name)
                if vname is None and name is None and _IGNORED.search(hf_name):
                    continue
                if name == "head.weight" and cfg.tie_word_embeddings:
                    continue
                if vname not in vshapes and name not in expected:
                    raise UnsupportedModelError(f"{file}: tensor '{hf_name}' is not part of a {cfg.arch}-VL "
                                                "model as configured in config.json")
                try:
                    t = f.get_tensor(hf_name)
                except Exception as exc:
                    raise ModelLoadError(f"{file}: tensor '{hf_name}' cannot be read ({exc})") from exc
                if vname:
                    if vname == "vision.patch_embed.weight":  # Conv3d [hidden, C, T, P, P] -> a matrix
                        if t.dim() != 5 or t.numel() != vcfg.hidden_size * vcfg.patch_dim:
                            raise ModelLoadError(f"{file}: tensor '{hf_name}' has shape {tuple(t.shape)}, "
                                                 f"config says ({vcfg.hidden_size}, {vcfg.in_channels}, "
                                                 f"{vcfg.temporal_patch_size}, {vcfg.patch_size}, {vcfg.patch_size})")
                        t = t.reshape(vcfg.hidden_size, vcfg.patch_dim)
                    vision[vname] = t
                else:
                    text[name] = t
    missing = sorted(expected - text.keys()) + sorted(vshapes.keys() - vision.keys())
    if missing:
        raise ModelLoadError(f"{folder}: {len(missing)} weights missing, e.g. '{missing[0]}'")
    check_shapes(text, cfg, str(folder))
    for name, t in vision.items():
        if tuple(t.shape) != vshapes[name]:
            raise ModelLoadError(f"{folder}: weight '{name}' has shape {tuple(t.shape)}, config says {vshapes[name]}")
    return text, vision


@dataclass
class LoadedVLModel:
    config: ModelConfig                       # the language model ("qwen2", M-RoPE per vision.mrope_section)
    vision: VisionConfig
    weights: dict[str, torch.Tensor]          # language model, engine.config canonical names
    vision_weights: dict[str, torch.Tensor]   # vision tower, vision_weight_names
    tokenizer: object
    source: str


def load_hf_vl(folder: Path) -> LoadedVLModel:
    """Everything of a Qwen2.5-VL folder: configs, both weight sets, the tokenizer."""
    folder = Path(folder)
    cfg, vcfg = read_vl_config(folder)
    text, vision = load_vl_weights(folder, cfg, vcfg)
    return LoadedVLModel(config=cfg, vision=vcfg, weights=text, vision_weights=vision,
                         tokenizer=load_hf_tokenizer(folder, cfg), source=str(folder))


__all__ = ["VL_ARCHS", "LoadedVLModel", "is_vl_folder", "load_hf_vl", "load_vl_weights", "read_processor_config",
           "read_vl_config", "text_canonical_name", "vision_canonical_name", "vision_weight_names"]
