"""GGUF files: metadata -> ModelConfig, tensors -> canonical weights, tokenizer metadata -> tokenizer.

Read with the `gguf` package's memory-mapped `GGUFReader`. F32/F16/BF16 tensors keep their precision;
quantized ones (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, ...) are dequantized to float32. The compute dtype
(`config.dtype`) is the matrices' most common type, float32 where any is quantized; every weight is then
in that dtype or float32 (the norms, biases and MoE routers the converter keeps in F32): a 16-bit tensor
of another type (an F16 embedding in a quantized file, BF16 next to F16) is widened to float32, which
holds it exactly. llama.cpp's converter permutes the rows of Q and K for the "llama" architecture (its
RoPE rotates adjacent pairs, transformers' rotates halves); that permutation is undone here so the
weights are in transformers' layout. A llama3-style `rope_freqs.weight` tensor is turned back into a
Hugging Face rope_scaling dict.

Mixtures of experts: `qwen3moe` files, and `llama` files with `llama.expert_count` (Mixtral), become the
qwen3_moe and mixtral architectures. Their router is `ffn_gate_inp`; the experts are stacked per layer
(`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`, or a fused `ffn_gate_up_exps`; older Mixtral files store
`ffn_gate.{e}` per expert) and are split into the engine's per-expert names. llama.cpp always renormalises
the top-k routing weights of both, so `norm_topk_prob` is set.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from engine.config import ModelConfig, weight_names
from engine.errors import ModelLoadError, UnsupportedModelError
from engine.loading.gguf_tokenizer import EOG_TEXTS, build_gguf_tokenizer
from engine.loading.rope_factors import llama3_scaling_from_factors
from engine.loading.tokenizer import ChatTokenizer

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe")
_MOE_ARCH = {"qwen3moe": "qwen3_moe", "llama": "mixtral"}   # GGUF arch with experts -> ModelConfig.arch
_PERMUTED_ARCHS = ("llama",)
_UNQUANTIZED = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    "attn_q.weight": "q.weight", "attn_k.weight": "k.weight", "attn_v.weight": "v.weight",
    "attn_output.weight": "o.weight", "attn_q.bias": "q.bias", "attn_k.bias": "k.bias",
    "attn_v.bias": "v.bias", "attn_q_norm.weight": "q_norm.weight", "attn_k_norm.weight": "k_norm.weight",
    "ffn_gate.weight": "gate.weight", "ffn_up.weight": "up.weight", "ffn_down.weight": "down.weight",
    "ffn_gate_inp.weight": "router.weight",
}
_STACKED = {"ffn_gate_exps.weight": ("gate",), "ffn_up_exps.weight": ("up",), "ffn_down_exps.weight": ("down",),
            "ffn_gate_up_exps.weight": ("gate", "up")}
_PER_EXPERT = {"ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down"}
_TOP_NAMES = {"token_embd.weight": "embed.weight", "output_norm.weight": "norm.weight",
              "output.weight": "head.weight"}


def canonical_name(gguf_name: str) -> str | None:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    if parts[2] in _LAYER_NAMES:
        return f"layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    kind, _, rest = parts[2].partition(".")          # older Mixtral files: blk.N.ffn_gate.E.weight
    expert = rest.removesuffix(".weight")
    if kind in _PER_EXPERT and rest.endswith(".weight") and expert.isdigit():
        return f"layers.{parts[1]}.experts.{expert}.{_PER_EXPERT[kind]}.weight"
    return None


def unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's Q/K permute: per head, rows (pairs interleaved) -> (halves)."""
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2)
            .reshape(w.shape).contiguous())


def permute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter permutation (transformers' layout -> GGUF's), for writing test files."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GgufFile:
    """One GGUF file: `.config`, `.file_type`, `.weights()`, `.tokenizer()`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as fh:
                magic = fh.read(4)
        except OSError as exc:
            raise ModelLoadError(f"{self.path}: cannot be read ({exc.strerror or exc})") from exc
        if magic != b"GGUF":
            raise ModelLoadError(f"{self.path}: not a GGUF file (it does not start with 'GGUF')")
        try:
            from gguf import GGUFReader

            self.reader = GGUFReader(str(self.path), "r")
        except Exception as exc:  # ValueError, struct errors, mmap errors on truncated/corrupt files
            reason = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
            raise ModelLoadError(f"{self.path}: truncated or corrupt GGUF file ({reason})") from exc
        self.meta = dict(self.reader.fields)
        self.arch = self._get("general.architecture", str)
        if self.arch not in SUPPORTED_ARCHS:
            raise UnsupportedModelError(f"{self.path}: general.architecture '{self.arch}' is not supported "
                                        f"(supported: {', '.join(SUPPORTED_ARCHS)})")
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.config = self._read_config()
        self.file_type = self._file_type()

    # ---- metadata ----------------------------------------------------------------------------
    def _get(self, key: str, kind: type | None = None, default=...):
        field = self.meta.get(key)
        if field is None:
            if default is ...:
                raise ModelLoadError(f"{self.path}: required metadata '{key}' is missing")
            return default
        try:
            value = field.contents()
        except Exception as exc:
            raise ModelLoadError(f"{self.path}: metadata '{key}' cannot be read ({exc})") from exc
        if isinstance(value, float):
            value = float(str(np.float32(value)))  # 1e-05 stored as float32 reads back as 1e-05
        if kind is float and isinstance(value, int):
            value = float(value)
        if kind is not None and not isinstance(value, kind):
            raise ModelLoadError(f"{self.path}: metadata '{key}' = {value!r} is not a {kind.__name__}")
        return value

    def _read_config(self) -> ModelConfig:
        a = self.arch
        heads = self._get(f"{a}.attention.head_count", int)
        hidden = self._get(f"{a}.embedding_length", int)
        tokens = self._get("tokenizer.ggml.tokens", list, default=None)
        vocab = self._get(f"{a}.vocab_size", int, default=None)
        if vocab is None and "token_embd.weight" in self.tensors:
            vocab = int(self.tensors["token_embd.weight"].shape[1])
        vocab = vocab or (len(tokens) if tokens else None)
        if not vocab:
            raise ModelLoadError(f"{self.path}: vocabulary size unknown ({a}.vocab_size missing)")
        head_dim = self._get(f"{a}.attention.key_length", int, default=None) or hidden // heads
        rope_theta = self._get(f"{a}.rope.freq_base", float, default=10000.0)
        # End of generation as llama.cpp decides it: eos, eot, eom and the known end-of-turn tokens.
        eos = [self._get(f"tokenizer.ggml.{k}_token_id", int, default=None) for k in ("eos", "eot", "eom")]
        eos += [i for i, t in enumerate(tokens or ()) if t in EOG_TEXTS]
        bos = self._get("tokenizer.ggml.bos_token_id", int, default=None)
        return ModelConfig(
            arch=_MOE_ARCH[a] if self._get(f"{a}.expert_count", int, default=0) else a,
            vocab_size=vocab, hidden_size=hidden,
            intermediate_size=self._get(f"{a}.feed_forward_length", int),
            num_layers=self._get(f"{a}.block_count", int),
            num_heads=heads,
            num_kv_heads=self._get(f"{a}.attention.head_count_kv", int, default=heads),
            head_dim=head_dim,
            rms_norm_eps=self._get(f"{a}.attention.layer_norm_rms_epsilon", float, default=1e-5),
            rope_theta=rope_theta,
            rope_scaling=self._rope_scaling(head_dim, rope_theta),
            max_position_embeddings=self._get(f"{a}.context_length", int, default=4096),
            tie_word_embeddings="output.weight" not in self.tensors,
            attention_bias="blk.0.attn_q.bias" in self.tensors,
            qk_norm="blk.0.attn_q_norm.weight" in self.tensors,
            sliding_window=self._get(f"{a}.attention.sliding_window", int, default=None),
            dtype=self._dtype(),
            bos_token_id=bos,
            eos_token_ids=tuple(dict.fromkeys(i for i in eos if i is not None)),
            **self._moe_fields(),
        )

    def _moe_fields(self) -> dict:
        a = self.arch
        experts = self._get(f"{a}.expert_count", int, default=0)
        if not experts:
            if a == "qwen3moe":
                raise ModelLoadError(f"{self.path}: required metadata '{a}.expert_count' is missing")
            return {}
        if a not in _MOE_ARCH:
            raise UnsupportedModelError(f"{self.path}: {a} with experts is not supported "
                                        f"(supported: {', '.join(_MOE_ARCH)})")
        gating = self._get(f"{a}.expert_gating_func", int, default=1)
        if gating != 1:
            raise UnsupportedModelError(f"{self.path}: {a}.expert_gating_func {gating} is not supported "
                                        "(only 1, softmax)")
        used = self._get(f"{a}.expert_used_count", int)
        if not 0 < used <= experts:
            raise ModelLoadError(f"{self.path}: metadata '{a}.expert_used_count' = {used} is not between 1 "
                                 f"and the {experts} experts")
        width = self._get(f"{a}.expert_feed_forward_length", int, default=None)
        return {"num_experts": experts, "num_experts_per_tok": used, "norm_topk_prob": True,
                "moe_intermediate_size": width or self._get(f"{a}.feed_forward_length", int)}

    def _rope_scaling(self, head_dim: int, rope_theta: float) -> tuple | None:
        kind = self._get(f"{self.arch}.rope.scaling.type", str, default="none")
        if "rope_freqs.weight" in self.tensors:
            factors = self._tensor(self.tensors["rope_freqs.weight"]).float()
            scaling = llama3_scaling_from_factors(factors, head_dim, rope_theta)
            if scaling is None:
                raise UnsupportedModelError(f"{self.path}: rope_freqs.weight does not follow llama3 "
                                            "rope scaling")
            return tuple(sorted(scaling.items())) if scaling else None
        if kind in ("none", ""):
            return None
        if kind == "linear":
            return (("factor", self._get(f"{self.arch}.rope.scaling.factor", float)), ("rope_type", "linear"))
        if kind == "yarn":
            return (("factor", self._get(f"{self.arch}.rope.scaling.factor", float)),
                    ("original_max_position_embeddings",
                     self._get(f"{self.arch}.rope.scaling.original_context_length", int)),
                    ("rope_type", "yarn"))
        raise UnsupportedModelError(f"{self.path}: {self.arch}.rope.scaling.type '{kind}' is not supported")

    def _matrix_types(self) -> list[str]:
        return [t.tensor_type.name for t in self.reader.tensors if len(t.shape) >= 2]

    def _dtype(self) -> str:
        types = self._matrix_types()
        if any(t not in _UNQUANTIZED for t in types):
            return "float32"   # quantized weights are dequantized to float32
        return _UNQUANTIZED[max(set(types), key=types.count)] if types else "float32"

    def _file_type(self) -> str:
        from gguf import LlamaFileType

        code = self._get("general.file_type", int, default=None)
        try:
            return LlamaFileType(code).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            types = self._matrix_types()
            return max(set(types), key=types.count) if types else "F32"

    # ---- weights -----------------------------------------------------------------------------
    def _tensor(self, t) -> torch.Tensor:
        from gguf.quants import dequantize

        shape = tuple(int(d) for d in reversed(t.shape))
        kind = t.tensor_type.name
        try:
            if kind == "F32":
                arr = np.array(t.data, dtype=np.float32)
            elif kind == "F16":
                arr = np.array(t.data, dtype=np.float16)
            elif kind == "BF16":
                raw = torch.from_numpy(np.array(t.data).view(np.int16).copy())
                return raw.view(torch.bfloat16).reshape(shape)
            else:
                arr = dequantize(t.data, t.tensor_type)
        except NotImplementedError as exc:
            raise UnsupportedModelError(f"{self.path}: tensor '{t.name}' has type {kind}, which cannot be "
                                        "dequantized") from exc
        except Exception as exc:
            raise ModelLoadError(f"{self.path}: tensor '{t.name}' cannot be read ({exc})") from exc
        return torch.from_numpy(np.ascontiguousarray(arr)).reshape(shape)

    def weights(self) -> dict[str, torch.Tensor]:
        """All weights under canonical names (Q/K un-permuted for llama)."""
        from engine.loading.hf import check_shapes

        cfg = self.config
        expected = {n for group in weight_names(cfg).values() for n in group}
        out: dict[str, torch.Tensor] = {}
        for name, t in self.tensors.items():
            parts = name.split(".", 2)
            if cfg.is_moe and len(parts) == 3 and parts[2] in _STACKED and parts[1].isdigit():
                out.update(self._split_experts(t, int(parts[1]), _STACKED[parts[2]]))
                continue
            canon = canonical_name(name)
            if canon is None or canon not in expected:
                if name == "rope_freqs.weight":
                    continue
                raise UnsupportedModelError(f"{self.path}: tensor '{name}' is not part of a {cfg.arch} model")
            w = self._tensor(t)
            if self.arch in _PERMUTED_ARCHS and canon.endswith((".q.weight", ".k.weight", ".q.bias",
                                                                ".k.bias")):
                heads = cfg.num_heads if ".q." in canon else cfg.num_kv_heads
                w = unpermute_rope_rows(w, heads)
            out[canon] = w
        compute = getattr(torch, cfg.dtype)
        for name, w in out.items():
            if w.dtype not in (compute, torch.float32):
                out[name] = w.float()
        missing = sorted(expected - out.keys())
        if missing:
            raise ModelLoadError(f"{self.path}: {len(missing)} weights missing, e.g. '{missing[0]}'")
        check_shapes(out, cfg, str(self.path))
        return out

    def _split_experts(self, t, layer: int, parts: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """A stacked [E, rows, cols] expert tensor -> one tensor per expert (and part)."""
        cfg = self.config
        if not cfg.is_moe_layer(layer):
            raise UnsupportedModelError(f"{self.path}: tensor '{t.name}' is not part of a {cfg.arch} model")
        w = self._tensor(t)
        f, h = cfg.moe_intermediate_size, cfg.hidden_size
        want = (cfg.num_experts, h, f) if parts == ("down",) else (cfg.num_experts, len(parts) * f, h)
        if tuple(w.shape) != want:
            raise ModelLoadError(f"{self.path}: tensor '{t.name}' has shape {tuple(w.shape)}, metadata says "
                                 f"{want}")
        out = {}
        for e in range(cfg.num_experts):
            for j, part in enumerate(parts):
                out[f"layers.{layer}.experts.{e}.{part}.weight"] = w[e] if len(parts) == 1 else w[e, j * f:(j + 1) * f]
        return out

    # ---- tokenizer ---------------------------------------------------------------------------
    def tokenizer(self) -> ChatTokenizer:
        from tokenizers import processors

        tokens = self._get("tokenizer.ggml.tokens", list)
        types = self._get("tokenizer.ggml.token_type", list, default=None) or [1] * len(tokens)
        model = self._get("tokenizer.ggml.model", str)
        backend = build_gguf_tokenizer(
            model, tokens, types, pre=self._get("tokenizer.ggml.pre", str, default=""),
            merges=self._get("tokenizer.ggml.merges", list, default=None),
            scores=self._get("tokenizer.ggml.scores", list, default=None),
            add_space_prefix=self._get("tokenizer.ggml.add_space_prefix", bool, default=model == "llama"),
            source=str(self.path))
        cfg = self.config
        bos = tokens[cfg.bos_token_id] if cfg.bos_token_id is not None and cfg.bos_token_id < len(tokens) else None
        add_bos = self._get("tokenizer.ggml.add_bos_token", bool, default=model == "llama")
        add_eos = self._get("tokenizer.ggml.add_eos_token", bool, default=False)
        eos_id = cfg.eos_token_ids[0] if cfg.eos_token_ids else None
        eos = tokens[eos_id] if eos_id is not None and eos_id < len(tokens) else None
        parts = [(bos, add_bos and bos is not None), (eos, add_eos and eos is not None)]
        single = " ".join([f"{bos}:0"] * parts[0][1] + ["$A:0"] + [f"{eos}:0"] * parts[1][1])
        backend.post_processor = processors.TemplateProcessing(
            single=single, pair=f"{single} $B:1",
            special_tokens=[(t, backend.token_to_id(t)) for t, on in parts if on])
        eog = {i for i in cfg.eos_token_ids if i < len(tokens)}
        return ChatTokenizer(backend, bos_token=bos, eos_token=eos, eos_token_ids=eog,
                             chat_template=self._get("tokenizer.chat_template", str, default=None),
                             name=self.path.name)
