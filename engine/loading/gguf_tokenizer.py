"""A `tokenizers.Tokenizer` rebuilt from GGUF tokenizer metadata, tokenizing as llama.cpp does.

Two vocabulary kinds (`tokenizer.ggml.model`): "gpt2" (byte-level BPE with merges; the pre-tokenizer
regexes are chosen by `tokenizer.ggml.pre`, applied one after another with matches and gaps kept, as
llama.cpp splits) and "llama" (SentencePiece-style BPE over scores, with "▁" for spaces, a space
prefix before every text run, and byte fallback). CONTROL tokens become special added tokens (split out
of chat-template text, skipped when decoding); USER_DEFINED tokens are always split out and kept.
"""

from __future__ import annotations

from engine.errors import UnsupportedModelError

# GGUF token types (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Hugging Face's regex forms of the splits llama.cpp applies for each `tokenizer.ggml.pre` value.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    "llama3": (_LLAMA3,), "qwen2": (_QWEN2,), "qwen35": (_QWEN35,), "gpt2": (_GPT2,),
    "starcoder": (r"\p{N}", _GPT2),
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}"),
}
_PRE_ALIASES = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "dbrx",
                     "smaug-bpe", "lfm2"), "llama3"),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "hunyuan"), "qwen2"),
    "qwen35": "qwen35",
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "roberta-bpe"), "gpt2"),
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva"),
                    "starcoder"),
    "default": "default", "": "default", "falcon": "falcon", "deepseek-coder": "deepseek-coder",
}
_IGNORE_MERGES = {"llama3"}   # a word that is itself a token is taken whole (llama.cpp's ignore_merges)

# Token texts llama.cpp treats as end of generation (and forces to CONTROL).
EOG_TEXTS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>",
                       "<|eom_id|>", "<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<eos>"})


def spm_merges(tokens: list[str], scores: list[float], types: list[int] | None = None
               ) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-driven merging: every split (l, r) of a token
    whose halves are tokens too, ranked by the merged token's score (highest first)."""
    mergeable = {t: i for i, t in enumerate(tokens)
                 if types is None or types[i] in (NORMAL, USER_DEFINED, 0)}
    ranked = []
    for i, piece in enumerate(tokens):
        if piece not in mergeable or mergeable[piece] != i:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-scores[i], mergeable[left], mergeable[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _added_tokens(tokens: list[str], types: list[int]):
    from tokenizers import AddedToken

    out = []
    for t, kind in zip(tokens, types):
        if kind in (CONTROL, UNKNOWN) or t in EOG_TEXTS:
            out.append(AddedToken(t, special=True, normalized=False))
        elif kind == USER_DEFINED:
            out.append(AddedToken(t, special=False, normalized=False))
    return out


def build_gguf_tokenizer(model: str, tokens: list[str], types: list[int], *, pre: str = "",
                         merges: list[str] | None = None, scores: list[float] | None = None,
                         add_space_prefix: bool = True, source: str = "gguf"):
    """The `tokenizers.Tokenizer` for a GGUF vocabulary (no post-processor: BOS is the caller's)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    if model == "gpt2":
        kind = _PRE_ALIASES.get(pre)
        if kind is None:
            raise UnsupportedModelError(f"{source}: tokenizer.ggml.pre '{pre}' is not supported "
                                        f"(supported: {', '.join(sorted(k for k in _PRE_ALIASES if k))})")
        pairs = [(m[:cut], m[cut + 1:]) for m in (merges or []) if (cut := m.find(" ", 1)) > 0]
        tok = Tokenizer(models.BPE(vocab, pairs, ignore_merges=kind in _IGNORE_MERGES))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_SPLITS[kind]]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
    elif model == "llama":
        unk = next((t for t, k in zip(tokens, types) if k == UNKNOWN), None)
        merge_list = spm_merges(tokens, scores or [0.0] * len(tokens), types)
        tok = Tokenizer(models.BPE(vocab, merge_list, unk_token=unk, fuse_unk=True, byte_fallback=True))
        steps = [normalizers.Prepend("▁")] if add_space_prefix else []
        tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
        dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence(dec + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    else:
        raise UnsupportedModelError(f"{source}: tokenizer.ggml.model '{model}' is not supported "
                                    "(supported: gpt2, llama)")
    tok.add_special_tokens(_added_tokens(tokens, types))
    return tok
