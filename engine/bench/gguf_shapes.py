"""Random-weight GGUF files of named model shapes, for llama.cpp baselines (speed depends on values only
through a MoE model's routing).

    python -m engine.bench.gguf_shapes llama3-8b /tmp/llama3-8b.gguf [--vocab-dir DIR] [--layers N]

Shapes: the dense Llama-3-8B (from `engine.bench.shapes`), the Qwen3-30B-A3B mixture of experts (its
published config; `--layers` keeps the first N of its 48 layers) and tiny versions of both for dry runs.
Weights are F16 by default (llama.cpp's most optimised 16-bit path; bf16 has the same bytes), BF16, or
F32 holding the F16 file's values (a reference for tests), drawn once (normal) and reused as views, so a
16 GB file takes seconds plus the disk write; the standard deviations are the engine's random models'
(`engine.loading.random_init.random_std`: 0.02, a wide embedding and narrow residual writes), so that a MoE
shape's tokens spread over the experts as a trained model's do instead of all routing alike.
The tokenizer metadata is copied from a vocabulary-only GGUF of the model family when one is found in
`--vocab-dir` (llama.cpp ships them: models/ggml-vocab-*.gguf), padded with unused tokens to the shape's
vocabulary size; otherwise a synthetic SentencePiece-style vocabulary of the right size is written
(byte tokens plus numbered pieces): enough for llama-bench, which feeds random token ids.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class GgufShape:
    arch: str                 # "llama" | "qwen3moe"
    vocab: int
    hidden: int
    ffn: int                  # dense FFN width (MoE: unused by llama.cpp but written)
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    eps: float
    context: int
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0
    vocab_file: str = "ggml-vocab-llama-bpe.gguf"

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def layer_tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name suffix, numpy shape rows x cols) of one layer's weights, norms excluded."""
        d, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        ts = [("attn_q.weight", (q, d)), ("attn_k.weight", (kv, d)), ("attn_v.weight", (kv, d)),
              ("attn_output.weight", (d, q))]
        if self.is_moe:
            e, f = self.experts, self.expert_ffn
            ts += [("ffn_gate_exps.weight", (e, f, d)), ("ffn_up_exps.weight", (e, f, d)),
                   ("ffn_down_exps.weight", (e, d, f))]
        else:
            ts += [("ffn_gate.weight", (self.ffn, d)), ("ffn_up.weight", (self.ffn, d)),
                   ("ffn_down.weight", (d, self.ffn))]
        return ts

    def weight_bytes(self, dtype_bytes: int = 2) -> dict[str, int]:
        """Bytes per part as llama.cpp stores them: token_embd, output, one layer's attn and ffn."""
        attn = sum(int(np.prod(s)) for n, s in self.layer_tensors() if n.startswith("attn"))
        ffn = sum(int(np.prod(s)) for n, s in self.layer_tensors() if n.startswith("ffn"))
        attn_norms = 4 * (self.hidden + (2 * self.head_dim if self.is_moe else 0))   # f32 norms
        router = 4 * self.experts * self.hidden                                        # f32 router
        layer_attn = attn * dtype_bytes + attn_norms
        layer_ffn = ffn * dtype_bytes + 4 * self.hidden + router
        return {"token_embd": self.vocab * self.hidden * dtype_bytes,
                "output": self.vocab * self.hidden * dtype_bytes + 4 * self.hidden,
                "layer_attn": layer_attn, "layer_ffn": layer_ffn, "layer": layer_attn + layer_ffn}


def _from_engine(name: str) -> GgufShape:
    from engine.bench.shapes import get_shape

    c = get_shape(name)
    return GgufShape("llama", c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads,
                     c.num_kv_heads, c.head_dim, c.rope_theta, c.rms_norm_eps, 8192)


# Qwen3-30B-A3B's published config.json (48 layers; the benchmark keeps fewer and says so).
QWEN3_30B_A3B = GgufShape("qwen3moe", 151936, 2048, 6144, 48, 32, 4, 128, 1e6, 1e-6, 32768,
                          experts=128, experts_used=8, expert_ffn=768, vocab_file="ggml-vocab-qwen2.gguf")
TINY = {
    "tiny-llama": GgufShape("llama", 512, 256, 512, 2, 4, 2, 64, 10000.0, 1e-5, 2048),
    "tiny-moe": GgufShape("qwen3moe", 512, 256, 512, 2, 4, 2, 64, 1e6, 1e-6, 2048, experts=8,
                          experts_used=2, expert_ffn=128, vocab_file="ggml-vocab-qwen2.gguf"),
}


def gguf_shape(name: str, layers: int | None = None) -> GgufShape:
    if name in TINY:
        shape = TINY[name]
    elif name == "qwen3-30b-a3b":
        shape = QWEN3_30B_A3B
    else:
        shape = _from_engine(name)
    return replace(shape, layers=layers) if layers else shape


# ---- tokenizer metadata ----------------------------------------------------------------------------
def _copy_vocab(writer, vocab_path: Path, n_vocab: int) -> int:
    """Copy tokenizer.* fields from a vocab-only GGUF, padded to n_vocab tokens; returns its own count."""
    import gguf

    reader = gguf.GGUFReader(str(vocab_path))
    fields = {f.name: f for f in reader.fields.values() if f.name.startswith("tokenizer.")}
    tokens = [bytes(fields["tokenizer.ggml.tokens"].parts[i]).decode("utf-8", "replace")
              for i in fields["tokenizer.ggml.tokens"].data]
    own = len(tokens)
    tokens = tokens[:n_vocab] + [f"[PAD{i}]" for i in range(own, n_vocab)]
    for name, f in fields.items():
        t = f.types[0]
        if name == "tokenizer.ggml.tokens":
            writer.add_token_list(tokens)
        elif name in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            vals = f.contents()[:n_vocab]
            pad = [gguf.TokenType.UNUSED if "type" in name else 0.0] * (n_vocab - len(vals))
            writer.add_key_value(name, vals + pad, t, sub_type=f.types[-1])
        elif t == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, f.contents(), t, sub_type=f.types[-1])
        else:
            value = f.contents()
            if isinstance(value, int) and name.endswith("_id") and value >= n_vocab:
                continue                       # a special token outside a truncated vocabulary
            writer.add_key_value(name, value, t)
    return own


def _synthetic_vocab(writer, n_vocab: int) -> None:
    import gguf

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    tokens += [f"\u2581t{i}" for i in range(n_vocab - len(tokens))]
    types += [gguf.TokenType.NORMAL] * (n_vocab - len(types))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(n_vocab)])
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


# ---- writing -------------------------------------------------------------------------------------
def write_gguf(shape: GgufShape, out: Path, vocab_dir: Path | None = None, dtype: str = "f16",
               seed: int = 0) -> dict:
    """Write `shape` with random weights to `out`; returns facts about the file."""
    import gguf

    from engine.loading.random_init import random_std

    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out), shape.arch)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.eps)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    if shape.arch == "llama":
        w.add_rope_dimension_count(shape.head_dim)
    if shape.is_moe:
        w.add_expert_count(shape.experts)
        w.add_expert_used_count(shape.experts_used)
        w.add_expert_feed_forward_length(shape.expert_ffn)
    w.add_file_type({"bf16": gguf.LlamaFileType.MOSTLY_BF16, "f32": gguf.LlamaFileType.ALL_F32}.get(
        dtype, gguf.LlamaFileType.MOSTLY_F16))
    vocab_path = vocab_dir / shape.vocab_file if vocab_dir else None
    if vocab_path is not None and vocab_path.is_file():
        own = _copy_vocab(w, vocab_path, shape.vocab)
        vocab = {"source": vocab_path.name, "tokens_in_source": own, "padded_to": shape.vocab}
    else:
        _synthetic_vocab(w, shape.vocab)
        vocab = {"source": "synthetic (byte tokens + numbered pieces)", "padded_to": shape.vocab}

    rng = np.random.default_rng(seed)
    biggest = max([shape.vocab * shape.hidden] + [int(np.prod(s)) for _, s in shape.layer_tensors()])
    unit = rng.standard_normal(biggest, dtype=np.float32)
    bases: dict[float, np.ndarray] = {}      # one base per standard deviation (`random_std`)

    def base_of(std: float) -> np.ndarray:
        if std not in bases:
            b = (unit * std).astype(np.float16)
            if dtype == "bf16":
                b = (b.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
            elif dtype == "f32":         # the f16 file's values exactly (a reference for readers without f16)
                b = b.astype(np.float32)
            bases[std] = b
        return bases[std]
    raw = gguf.GGMLQuantizationType.BF16 if dtype == "bf16" else None

    def add(name: str, shape_: tuple[int, ...]) -> None:
        arr = base_of(random_std(name))[:int(np.prod(shape_))].reshape(shape_)
        if raw is None:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, arr, raw_shape=arr.shape, raw_dtype=raw)

    ones = lambda n: np.ones(n, np.float32)
    add("token_embd.weight", (shape.vocab, shape.hidden))
    w.add_tensor("output_norm.weight", ones(shape.hidden))
    add("output.weight", (shape.vocab, shape.hidden))
    for i in range(shape.layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones(shape.hidden))
        w.add_tensor(p + "ffn_norm.weight", ones(shape.hidden))
        if shape.is_moe:
            w.add_tensor(p + "attn_q_norm.weight", ones(shape.head_dim))
            w.add_tensor(p + "attn_k_norm.weight", ones(shape.head_dim))
            router = (rng.standard_normal((shape.experts, shape.hidden)) * 0.02).astype(np.float32)
            w.add_tensor(p + "ffn_gate_inp.weight", router)
        for suffix, s in shape.layer_tensors():
            add(p + suffix, s)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return {"path": str(out), "bytes": out.stat().st_size, "dtype": dtype, "layers": shape.layers,
            "arch": shape.arch, "vocab": vocab, "weight_stds": sorted(bases)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape")
    ap.add_argument("out")
    ap.add_argument("--vocab-dir", default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--dtype", choices=("f16", "bf16", "f32"), default="f16")
    args = ap.parse_args(argv)
    facts = write_gguf(gguf_shape(args.shape, args.layers), Path(args.out),
                       Path(args.vocab_dir) if args.vocab_dir else None, args.dtype)
    print(facts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
