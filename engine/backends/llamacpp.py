"""The llama.cpp backend: GGUF files run by llama-cpp-python at their own quantized precision.

llama.cpp evaluates the model (prompt and one token per step, reusing the KV cache of the previous
call's common prefix); the engine's own `Sampler` picks each token from llama.cpp's logits, so greedy,
temperature, top-k and top-p behave exactly as in the torch backend. Placement is llama.cpp's:
`n_gpu_layers` of the model on a CUDA build (chosen to fit the VRAM budget), everything on the CPU
otherwise; there are no sub-layer plans to force.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from engine.api import Engine
from engine.config import ModelConfig
from engine.errors import BadInputError, ContextLengthError, ModelLoadError, SlipstreamError
from engine.generation import CancelToken, Sampler, SamplingParams
from engine.loading.tokenizer import render_chat_template
from engine.units import parse_bytes

# OMP_WAIT_POLICY=PASSIVE is set by engine/__init__.py before llama.cpp's libraries load: its OpenMP
# threads spin while waiting by default, which on a desktop where a game keeps the cores busy collapses
# throughput (measured 3 tok/s instead of 30 with 2 threads on 2 busy cores).

DEFAULT_MAX_CONTEXT = 8192      # context allocated when n_ctx is not given (capped by the model's own)
_SCRATCH_RESERVE = 256 * 2**20  # VRAM kept for llama.cpp's compute buffers when choosing n_gpu_layers
_OPEN_LOCK = threading.Lock()


class LlamaCppEngine(Engine):
    """A GGUF model run by llama.cpp. `opts` pass through to `llama_cpp.Llama` (e.g. n_batch)."""

    backend = "llamacpp"

    def __init__(self, path, device: str = "auto", vram_budget=None, n_ctx: int | None = None,
                 n_threads: int | None = None, **opts) -> None:
        super().__init__()
        self._lc = import_llama_cpp()
        self._path = Path(path)
        self.source = str(self._path)
        self._gpu = bool(self._lc.llama_supports_gpu_offload())
        self._main_gpu = _check_device(device, self._gpu)
        self._n_threads = int(n_threads or _default_threads())
        self._n_ctx_wanted = n_ctx
        self._opts = opts
        self._budget = None if vram_budget is None else parse_bytes(vram_budget, "vram_budget")
        self._llm = None
        self._batch = None
        self._cached: list[int] = []        # tokens whose K/V sit in llama.cpp's cache (sequence 0)
        self._pending_layers: int | None = None
        self._n_gpu_layers = 0
        llm = self._open(0)
        self._n_layer = int(self._lc.llama_model_n_layer(llm.model))
        self.tokenizer = LlamaCppTokenizer(self._lc, llm)
        self.config = config_from_metadata(llm.metadata, self.tokenizer.vocab_size)
        n_train = int(self._lc.llama_model_n_ctx_train(llm.model))
        self.context_length = int(llm.n_ctx()) if n_ctx else min(int(llm.n_ctx()), n_train)
        if self._gpu and self._main_gpu is not None:
            layers = self._layers_for_budget(self._budget)
            if layers:
                self._reopen(layers)

    # ---- opening and placement -----------------------------------------------------------------
    def _open(self, n_gpu_layers: int):
        lc = self._lc
        n_ctx = self._n_ctx_wanted or DEFAULT_MAX_CONTEXT
        kwargs = {"n_ctx": n_ctx, "n_threads": self._n_threads, "n_threads_batch": self._n_threads,
                  "n_gpu_layers": n_gpu_layers, "main_gpu": self._main_gpu or 0, "verbose": False}
        kwargs.update(self._opts)
        llm = open_llama(self._path, **kwargs)
        n_batch = int(llm.n_batch)
        batch = lc.llama_batch_init(n_batch, 0, 1)
        self._llm, self._batch, self._n_batch = llm, batch, n_batch
        self._n_vocab = int(llm.n_vocab())
        self._n_gpu_layers = n_gpu_layers
        if self.tokenizer is not None:
            self.tokenizer.rebind(llm)
        self._cached = []
        return llm

    def _free(self) -> None:
        if self._batch is not None:
            self._lc.llama_batch_free(self._batch)
            self._batch = None
        if self._llm is not None:
            if self.tokenizer is not None:
                self.tokenizer.rebind(None)
            self._llm.close()
            self._llm = None
        self._cached = []

    def _reopen(self, n_gpu_layers: int) -> None:
        """Reload with another placement; the next step re-evaluates the tokens it needs. Where the
        GPU placement cannot be loaded (out of memory), fall back to the CPU rather than fail."""
        self._free()
        try:
            self._open(n_gpu_layers)
        except ModelLoadError:
            if n_gpu_layers == 0:
                raise
            self._open(0)

    def _layers_for_budget(self, budget: int | None) -> int:
        """How many layers (output head first, as llama.cpp offloads them) fit in `budget` bytes."""
        if not self._gpu or self._main_gpu is None:
            return 0
        if budget is None:
            return self._n_layer + 1
        per_layer = self._layer_bytes()
        room = budget - _SCRATCH_RESERVE
        return max(0, min(self._n_layer + 1, int(room // max(per_layer, 1)))) if room > 0 else 0

    def _layer_bytes(self) -> int:
        """Weights plus KV cache of one layer (the head counted as a layer), estimated from the model."""
        weights = int(self._lc.llama_model_size(self._llm.model)) // (self._n_layer + 1)
        cfg = self.config
        kv = 0 if cfg is None else 2 * 2 * int(self._llm.n_ctx()) * cfg.kv_size   # K and V, f16
        return weights + kv

    def _apply_pending(self) -> None:
        layers, self._pending_layers = self._pending_layers, None
        if layers is not None and layers != self._n_gpu_layers:
            self._reopen(layers)

    # ---- evaluation ----------------------------------------------------------------------------
    def _check_ids(self, ids: list[int]) -> None:
        bad = [t for t in ids if not 0 <= t < self._n_vocab]
        if bad:
            raise BadInputError(f"token id {bad[0]} is outside the vocabulary of {self._n_vocab} tokens")

    def _decode(self, tokens: list[int], start: int, all_logits: bool) -> np.ndarray:
        """Evaluate `tokens` at positions start.. (after the cached prefix); return logits rows
        [len(tokens), vocab] when all_logits, else the last row [vocab]."""
        if self._llm is None:
            raise BadInputError(f"{self._path.name}: the engine is closed")
        lc, ctx, b = self._lc, self._llm.ctx, self._batch
        mem = lc.llama_get_memory(ctx)
        if not lc.llama_memory_seq_rm(mem, 0, start, -1):   # caches that cannot drop a suffix (recurrent)
            lc.llama_memory_clear(mem, True)
            tokens, start = self._cached[:start] + list(tokens), 0
        del self._cached[start:]
        rows = []
        for i in range(0, len(tokens), self._n_batch):
            chunk = tokens[i:i + self._n_batch]
            b.n_tokens = len(chunk)
            for j, t in enumerate(chunk):
                b.token[j], b.pos[j], b.n_seq_id[j] = t, start + i + j, 1
                b.seq_id[j][0] = 0
                b.logits[j] = all_logits or j == len(chunk) - 1
            rc = lc.llama_decode(ctx, b)
            if rc != 0:
                lc.llama_memory_seq_rm(lc.llama_get_memory(ctx), 0, start + i, -1)
                if rc == 1:
                    raise ContextLengthError(f"{start + len(tokens)} tokens do not fit the llama.cpp "
                                             f"context of {self._llm.n_ctx()} tokens")
                raise SlipstreamError(f"{self._path.name}: llama.cpp failed to evaluate tokens (code {rc})")
            self._cached.extend(chunk)
            if all_logits:
                ptr = lc.llama_get_logits(ctx)
                rows.append(np.ctypeslib.as_array(ptr, shape=(len(chunk), self._n_vocab)).copy())
        if all_logits:
            return np.concatenate(rows)
        ptr = lc.llama_get_logits_ith(ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self._n_vocab,)).copy()

    def _next_logits(self, seq: list[int]) -> np.ndarray:
        """Logits after `seq`, evaluating only what the KV cache does not already hold."""
        n = len(self._cached)
        if n < len(seq) and self._cached == seq[:n]:
            keep = n
        else:
            keep = 0
            limit = min(n, len(seq) - 1)
            while keep < limit and self._cached[keep] == seq[keep]:
                keep += 1
        return self._decode(seq[keep:], keep, all_logits=False)

    def _token_stream(self, ids: list[int], params: SamplingParams, cancel: CancelToken,
                      images) -> Iterator[int]:
        if params.max_new_tokens <= 0:
            return
        self._check_ids(ids)
        sampler = Sampler(params)
        seq = list(ids)
        while not cancel.cancelled:
            self._apply_pending()
            token = sampler(torch.from_numpy(self._next_logits(seq)))
            seq.append(token)
            yield token

    def score(self, token_ids) -> torch.Tensor:
        ids = [int(t) for t in (token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids)]
        if not ids:
            raise BadInputError("score: token_ids is empty")
        if len(ids) > self.context_length:
            raise ContextLengthError(f"score: {len(ids)} tokens do not fit the model's context of "
                                     f"{self.context_length} tokens")
        self._check_ids(ids)
        with self._lock:
            self._apply_pending()
            return torch.from_numpy(self._decode(ids, 0, all_logits=True))

    # ---- placement contract --------------------------------------------------------------------
    def set_vram_budget(self, n_bytes) -> None:
        """Record the budget; on a CUDA build re-place (n_gpu_layers) at the next step boundary."""
        self._budget = None if n_bytes is None else parse_bytes(n_bytes, "vram_budget")
        if not (self._gpu and self._main_gpu is not None):
            return
        self._pending_layers = self._layers_for_budget(self._budget)
        if self._lock.acquire(blocking=False):
            try:
                if self._cancel is None:     # not generating: apply now
                    self._apply_pending()
            finally:
                self._lock.release()

    def force_plan(self, kind: str) -> None:
        if kind != "auto":
            raise BadInputError(f"force_plan({kind!r}): the llama.cpp backend only has llama.cpp's own "
                                "layer placement ('auto'); use backend='torch' for sub-layer plans")

    def plan_report(self) -> dict:
        decode_tps = self._stats.get("decode_tokens_per_s")
        kv = 0 if self.config is None else 2 * 2 * int(self._llm.n_ctx()) * self.config.kv_size
        weights = int(self._lc.llama_model_size(self._llm.model)) // (self._n_layer + 1)
        return placement_report(self._n_layer, self._n_gpu_layers, self._budget, weights, kv,
                                1000.0 / decode_tps if decode_tps else 0.0)

    def stats(self) -> dict:
        s = dict(self._stats)
        s.update(backend=self.backend, n_gpu_layers=self._n_gpu_layers, n_threads=self._n_threads,
                 n_ctx=self.context_length)
        return s

    def close(self) -> None:
        with self._lock:
            self._free()


def _default_threads() -> int:
    """Physical cores (llama.cpp's own default; hyper-threads do not speed up its kernels)."""
    try:
        import psutil

        return int(psutil.cpu_count(logical=False) or os.cpu_count() or 1)
    except ImportError:
        return int(os.cpu_count() or 1)


def _check_device(device: str, gpu: bool) -> int | None:
    """The CUDA device index to offload to, or None for the CPU."""
    if device == "cpu":
        return None
    if device == "auto":
        return 0 if gpu else None
    if device == "cuda" or (isinstance(device, str) and device.startswith("cuda:")):
        if not gpu:
            raise BadInputError(f"device={device!r}: this llama-cpp-python build has no GPU support "
                                "(use device='cpu', or backend='torch' for CUDA)")
        idx = device.partition(":")[2] or "0"
        if not idx.isdigit():
            raise BadInputError(f"device={device!r}: expected 'cuda' or 'cuda:N'")
        return int(idx)
    if device == "sim":
        raise BadInputError("device='sim': the llama.cpp backend runs on the CPU or a CUDA GPU only "
                            "(use backend='torch' for the simulated device)")
    raise BadInputError(f"device={device!r}: expected 'auto', 'cpu', 'cuda' or 'cuda:N'")


def open_llama(path: Path, **kwargs):
    """`llama_cpp.Llama(path, **kwargs)` made safe on this machine (see `extra_buffers_safe`), with
    load failures as one-line `ModelLoadError`s. The tests open their llama.cpp references with it."""
    lc = import_llama_cpp()
    path = Path(path)
    _check_magic(path)
    try:
        with _model_params(lc, use_extra_bufts=extra_buffers_safe(lc)):
            return lc.Llama(str(path), **kwargs)
    except (ValueError, RuntimeError, OSError) as exc:
        if "context" in str(exc).lower():
            raise ModelLoadError(f"{path}: llama.cpp could not create a context of {kwargs.get('n_ctx')} "
                                 "tokens (out of memory? pass a smaller n_ctx)") from exc
        raise ModelLoadError(f"{path}: llama.cpp could not load this GGUF file (truncated, corrupt, "
                             "or an architecture this llama.cpp build does not know)") from exc


@contextlib.contextmanager
def _model_params(lc, **fields):
    """Set llama_model_params fields that `llama_cpp.Llama` has no argument for, by patching the
    defaults it starts from while it is being constructed (under a lock)."""
    low = lc.llama_cpp
    default = low.llama_model_default_params

    def patched():
        params = default()
        for name, value in fields.items():
            setattr(params, name, value)
        return params

    with _OPEN_LOCK:
        low.llama_model_default_params = patched
        try:
            yield
        finally:
            low.llama_model_default_params = default


def extra_buffers_safe(lc) -> bool:
    """Whether ggml's extra CPU buffer types (AMX tiles, repacked weights) may be used.

    On CPUs that advertise AMX, ggml's AMX kernels die with an illegal instruction on some virtual
    machines (the tile state does not survive there), killing the whole process. So a build with AMX
    compiled in runs without those buffers on AMX CPUs unless SLIPSTREAM_LLAMACPP_AMX=1 says it is safe.
    Consumer CPUs have no AMX and are unaffected."""
    if os.environ.get("SLIPSTREAM_LLAMACPP_AMX") == "1":
        return True
    if "AMX_INT8 = 1" not in lc.llama_print_system_info().decode(errors="replace"):
        return True
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_tile" not in f.read()
    except OSError:
        return True


def _check_magic(path: Path) -> None:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot be read ({exc.strerror})") from exc
    if magic != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (the file does not start with 'GGUF')")



def import_llama_cpp():
    """The llama_cpp module, or a one-line error saying how to get it."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise ModelLoadError("the llama.cpp backend needs llama-cpp-python "
                             "(pip install llama-cpp-python), or use backend='torch'") from exc
    return llama_cpp


class LlamaCppTokenizer:
    """The Tokenizer protocol over llama.cpp's own vocabulary (what the model was converted with)."""

    def __init__(self, lc, llm) -> None:
        self._lc = lc
        self._vocab = lc.llama_model_get_vocab(llm.model)
        self.vocab_size = int(lc.llama_vocab_n_tokens(self._vocab))
        bos = int(lc.llama_vocab_bos(self._vocab))
        eos = int(lc.llama_vocab_eos(self._vocab))
        self.bos_token_id = bos if bos >= 0 else None
        # End of generation as llama.cpp sees it: EOS, EOT and the model's other end tokens.
        self.eos_token_ids = {t for t in range(self.vocab_size) if lc.llama_vocab_is_eog(self._vocab, t)}
        self.add_bos = bool(lc.llama_vocab_get_add_bos(self._vocab))
        self.chat_template: str | None = llm.metadata.get("tokenizer.chat_template")
        self.bos_token = self._text(bos)
        self.eos_token = self._text(eos)

    def rebind(self, llm) -> None:
        """Follow a reopened model (its vocabulary lives in the model), or None once it is closed."""
        self._vocab = None if llm is None else self._lc.llama_model_get_vocab(llm.model)

    def _v(self):
        if self._vocab is None:
            raise BadInputError("the llama.cpp model is closed")
        return self._vocab

    def _text(self, token: int) -> str:
        return self._lc.llama_vocab_get_text(self._vocab, token).decode("utf-8", "replace") if token >= 0 else ""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special tokens written in the text (e.g. <|im_start|>) become their ids, as in HF."""
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (self._lc.llama_token * cap)()
        n = self._lc.llama_tokenize(self._v(), data, len(data), buf, cap, add_special_tokens, True)
        if n < 0:
            raise BadInputError(f"text of {len(data)} bytes could not be tokenized (llama.cpp code {n})")
        return list(buf[:n])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        ids = [int(t) for t in ids]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise BadInputError(f"token id {bad[0]} is outside the vocabulary of {self.vocab_size} tokens")
        if not ids:
            return ""
        arr = (self._lc.llama_token * len(ids))(*ids)
        size = 8 * len(ids) + 16
        while True:
            out = ctypes.create_string_buffer(size)
            n = self._lc.llama_detokenize(self._v(), arr, len(ids), out, size, False,
                                          not skip_special_tokens)
            if n >= 0:
                return out.raw[:n].decode("utf-8", "replace")
            size = -n + 16

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise BadInputError("this GGUF file has no tokenizer.chat_template: pass a plain string prompt")
        return render_chat_template(self.chat_template, messages, add_generation_prompt,
                                    bos_token=self.bos_token, eos_token=self.eos_token)


def config_from_metadata(meta: dict[str, str], vocab_size: int) -> ModelConfig | None:
    """A minimal ModelConfig from GGUF metadata (tie_word_embeddings is not recorded there: False)."""
    arch = meta.get("general.architecture")
    if not arch:
        return None

    def num(key: str, default=None, kind=int):
        v = meta.get(f"{arch}.{key}")
        return default if v is None else kind(float(v)) if kind is int else kind(v)

    try:
        hidden, heads = num("embedding_length"), num("attention.head_count")
        head_dim = num("attention.key_length", hidden // heads)
        return ModelConfig(
            arch=arch, vocab_size=vocab_size,
            hidden_size=hidden, intermediate_size=num("feed_forward_length", 0),
            num_layers=num("block_count"), num_heads=heads,
            num_kv_heads=num("attention.head_count_kv", heads), head_dim=head_dim,
            rms_norm_eps=num("attention.layer_norm_rms_epsilon", 1e-5, float),
            rope_theta=num("rope.freq_base", 10000.0, float),
            max_position_embeddings=num("context_length", 4096),
            bos_token_id=_int_or_none(meta.get("tokenizer.ggml.bos_token_id")),
            eos_token_ids=tuple(x for x in [_int_or_none(meta.get("tokenizer.ggml.eos_token_id"))]
                                if x is not None))
    except (TypeError, ValueError, ZeroDivisionError):
        return None


def _int_or_none(v) -> int | None:
    return None if v is None else int(v)


def placement_report(n_layer: int, n_gpu_layers: int, budget: int | None, layer_weights: int,
                     layer_kv: int, predicted_ms: float) -> dict:
    """The plan_report of llama.cpp's placement: the output head and the last n_gpu_layers - 1 layers
    are resident in VRAM; the embedding lookup and the other layers run on the CPU."""
    first_gpu = n_layer + 1 - n_gpu_layers
    placement = {"embed": "cpu"}
    for i in range(n_layer):
        where = "resident" if n_gpu_layers and i >= first_gpu else "cpu"
        placement[f"layers.{i}.attn"] = placement[f"layers.{i}.ffn"] = where
    placement["head"] = "resident" if n_gpu_layers >= 1 else "cpu"
    n_res_layers = sum(1 for i in range(n_layer) if n_gpu_layers and i >= first_gpu)
    weights = layer_weights * min(n_gpu_layers, n_layer + 1)
    kv = layer_kv * n_res_layers
    scratch = _SCRATCH_RESERVE if n_gpu_layers else 0
    plan = "cpu" if n_gpu_layers == 0 else "gpu_only" if n_gpu_layers > n_layer else "static"
    vram = {"weights": weights, "kv": kv, "slots": 0, "scratch": scratch, "total": weights + kv + scratch}
    return {"budget": budget if budget is not None else vram["total"], "backend": "llamacpp",
            "n_gpu_layers": n_gpu_layers,
            "tiers": [{"tokens": 1, "plan": plan, "predicted_ms": float(predicted_ms), "vram": vram,
                       "placement": placement,
                       "note": "llama.cpp places whole layers; every token tier uses this placement"}]}
