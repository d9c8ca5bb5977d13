"""Vision-language benchmark: the Qwen2.5-VL-7B shape, one 2560x1440 image, a short prompt, a VRAM budget.

    python -m engine.bench.vlm_bench --device cuda --budget 2.5GiB --out docs/benchmarks/gpu
    python -m engine.bench.vlm_bench --device sim --shape tiny        # the same harness, here, in seconds

Both systems get the same model (random bf16 weights drawn from the same seeds, on the GPU where there
is one), the same prompt token ids and the same pixels, each in its own subprocess (so peaks do not mix)
under a time limit:
- `slipstream`: the torch engine at the budget (vision weights streamed from host memory, the pass
  booked against the budget, then the language model under its plan). A warm-up generation with the
  same image first (kernels, the KV re-plan for the long prompt), then a vision-only pass whose torch
  allocator peak is compared with what the pass booked, then the timed generation.
- `accelerate`: transformers' Qwen2_5_VLForConditionalGeneration, `infer_auto_device_map(max_memory=
  {0: budget, "cpu": ...})` + `dispatch_model` (what `from_pretrained(device_map="auto", max_memory=...)`
  does), a warm-up with a small image, then the timed `generate`.
Per system: time to first token (image decode, vision pass and prefill included), total time for the new
tokens, decode tokens/s, peak VRAM (NVML for the whole process where pynvml works, else
torch.cuda.max_memory_reserved; Slipstream also its own accounting), and the generated ids (random
weights: agreement is reported, not required). JSON (command, machine, date) to `<out>/vlm_7b.json`
(`vlm_tiny.json` for the tiny shape). Progress lines go to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engine.units import format_bytes, parse_bytes

IMAGE_SIZE = (2560, 1440)
WARMUP_IMAGE = (448, 448)
PROMPT = "Describe this picture in one sentence."
SPECIALS = {"<|im_start|>": 151644, "<|im_end|>": 151645, "<|vision_start|>": 151652,
            "<|vision_end|>": 151653, "<|image_pad|>": 151655, "<|video_pad|>": 151656}

# Qwen2.5-VL-7B-Instruct's config.json and preprocessor_config.json (the shape; weights are random).
TEXT_7B = {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
           "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 128000,
           "rms_norm_eps": 1e-6, "hidden_act": "silu",
           "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}}
VISION_7B = {"depth": 32, "hidden_size": 1280, "num_heads": 16, "intermediate_size": 3420, "out_hidden_size": 3584,
             "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
             "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu", "in_chans": 3}
PIXELS_7B = {"min_pixels": 3136, "max_pixels": 12845056}
# A tiny model of the same structure, for dry runs here.
TEXT_TINY = {**TEXT_7B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32768,
             "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]}}
VISION_TINY = {**VISION_7B, "depth": 3, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64,
               "out_hidden_size": 64, "window_size": 56, "fullatt_block_indexes": [1]}
PIXELS_TINY = {"min_pixels": 3136, "max_pixels": 200_704}
SHAPES = {"7b": (TEXT_7B, VISION_7B, PIXELS_7B), "tiny": (TEXT_TINY, VISION_TINY, PIXELS_TINY)}


def say(msg: str) -> None:
    print(f"[vlm-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- the model, the prompt, the image ------------------------------------------------------------

def write_config(shape: str, folder: Path) -> Path:
    """config.json (+ preprocessor_config.json) of the shape, through transformers' own config class
    as the tests build the tiny model, so both systems read one description."""
    from transformers import Qwen2_5_VLConfig

    text, vision, pixels = SHAPES[shape]
    cfg = Qwen2_5_VLConfig(text_config=dict(text), vision_config=dict(vision), image_token_id=SPECIALS["<|image_pad|>"],
                           video_token_id=SPECIALS["<|video_pad|>"], vision_start_token_id=SPECIALS["<|vision_start|>"],
                           vision_end_token_id=SPECIALS["<|vision_end|>"], tie_word_embeddings=False)
    cfg.dtype = "bfloat16"
    folder.mkdir(parents=True, exist_ok=True)
    cfg.to_json_file(str(folder / "config.json"))
    pre = {**pixels, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "image_processor_type": "Qwen2VLImageProcessor"}
    (folder / "preprocessor_config.json").write_text(json.dumps(pre))
    return folder


class BenchTokenizer:
    """UTF-8 bytes as ids 0..255 plus the chat and vision special tokens at their Qwen2.5 ids; no
    end-of-sequence token, so every run generates exactly the tokens asked for."""

    bos_token_id = None
    add_bos = False
    _split = re.compile("(" + "|".join(re.escape(t) for t in SPECIALS) + ")")

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eos_token_ids: set[int] = set()

    def token_to_id(self, token: str) -> int | None:
        return SPECIALS.get(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out: list[int] = []
        for piece in self._split.split(text):
            out.extend([SPECIALS[piece]] if piece in SPECIALS else piece.encode("utf-8"))
        return out

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        parts = []
        for m in messages:
            content = m["content"]
            if isinstance(content, list):
                content = "".join("<|vision_start|><|image_pad|><|vision_end|>" if p.get("type") == "image"
                                  else p.get("text", "") for p in content)
            parts.append(f"<|im_start|>{m['role']}\n{content}<|im_end|>\n")
        return "".join(parts) + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def messages() -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]


def picture(width: int, height: int):
    """A synthetic photo-like picture: smooth colour gradients with a little noise (deterministic)."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    rgb = np.stack([255 * x / max(width - 1, 1), 255 * y / max(height - 1, 1),
                    127.5 * (1 + np.sin((x + y) / 37.0))], axis=-1)
    rgb += np.random.default_rng(0).normal(0, 12, rgb.shape)
    return Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8))


def prompt_inputs(vcfg, tokenizer, image):
    """(prompt ids, pixel_values, grids) exactly as the engine builds them."""
    from engine.models.vision.mrope import build_prompt_ids
    from engine.models.vision.qwen2_5_vl_processor import image_token_count, preprocess_images

    pixel_values, grids = preprocess_images([image], vcfg.processor)
    counts = [image_token_count(g, vcfg.spatial_merge_size) for g in grids.tolist()]
    return build_prompt_ids(tokenizer, messages(), counts), pixel_values, grids


def _generator(seed: int, device: str):
    import torch

    return torch.Generator(device=device).manual_seed(seed)


def random_tensor(name: str, shape, device: str, dtype):
    """The value of weight `name` (same in both processes): norms 1, the rest N(0, 0.02) from a seed
    derived from the name."""
    import zlib

    import torch

    if re.search(r"(norm|ln_q|layernorm)[^.]*\.weight$", name) or re.search(r"norm\d?\.weight$", name):
        return torch.ones(shape, dtype=dtype)
    g = _generator(zlib.crc32(name.encode()), device)
    t = torch.randn(shape, generator=g, device=device, dtype=torch.float32 if device == "cpu" else dtype)
    return (t * 0.02).to(dtype)


# ---- Slipstream -----------------------------------------------------------------------------------

def slipstream_model(folder: Path, gen_device: str):
    """A LoadedVLModel of the shape with random weights (HF names mapped as the loader maps them)."""
    import torch

    from engine.config import weight_names, weight_shape
    from engine.loading.hf_vision import LoadedVLModel, read_vl_config
    from engine.models.vision.qwen2_5_vl_tower import vision_weight_shapes

    cfg, vcfg = read_vl_config(folder)
    dtype = torch.bfloat16
    names = {n for group in weight_names(cfg).values() for n in group}
    text = {n: random_tensor(_HF_TEXT.get(n, n), weight_shape(cfg, n), gen_device, dtype).cpu() for n in sorted(names)}
    vision = {n: random_tensor(n, s, gen_device, dtype).cpu() for n, s in vision_weight_shapes(vcfg).items()}
    return LoadedVLModel(cfg, vcfg, text, vision, BenchTokenizer(cfg.vocab_size), f"random {folder.name}")


_HF_TEXT: dict[str, str] = {}     # engine name -> the HF name whose seed it uses (filled by _hf_names)


def run_slipstream(args) -> dict:
    import torch

    from engine.backends.torch_engine import TorchEngine
    from engine.bench.vram_poll import VramPoller

    cuda = args.device.startswith("cuda")
    gen = "cuda" if cuda else "cpu"
    folder = Path(args.config_dir)
    _hf_names(folder)
    t0 = time.perf_counter()
    model = slipstream_model(folder, gen)
    if cuda:
        torch.cuda.empty_cache()
    say(f"slipstream: random weights in {time.perf_counter() - t0:.0f} s")
    t0 = time.perf_counter()
    eng = TorchEngine(model, device=args.device, vram_budget=args.budget, profile=load_profile(args),
                      speculative=False)
    del model
    say(f"slipstream: opened in {time.perf_counter() - t0:.0f} s; budget {format_bytes(args.budget)}, "
        f"LM plan {eng.executor.plan.kind}, in use {format_bytes(eng.accel.total_used if eng.accel else 0)}")
    image = picture(*IMAGE_SIZE)
    ids, _, grids = prompt_inputs(eng.vision, eng.tokenizer, image)
    out = {"prompt_tokens": len(ids), "image_tokens": int(grids.prod()) // 4, "grid": grids[0].tolist()}
    say(f"slipstream: prompt of {len(ids)} tokens ({out['image_tokens']} image tokens, grid {out['grid']})")
    t0 = time.perf_counter()
    warm = [e.token_id for e in eng.generate(messages(), images=[image], max_new_tokens=2) if e.token_id is not None]
    out["warmup_s"] = round(time.perf_counter() - t0, 2)
    say(f"slipstream: warm-up generation in {out['warmup_s']} s")
    # The vision pass alone: what the torch allocator really took on the GPU beside what was booked.
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    eng.encode_prompt(messages(), [image])
    eng._vision_prompts.clear()
    last = dict(eng.vision_pass.last)
    out["vision_check"] = {"booked_bytes": last["booked_bytes"], "where": last["where"],
                           "measured_ms": round(last["measured_ms"], 1), "plan": last["plan"]}
    if cuda:
        out["vision_check"]["torch_allocated_peak_bytes"] = torch.cuda.max_memory_allocated() - base
    say(f"slipstream: vision pass {last['where']} {last['measured_ms']:.0f} ms (predicted "
        f"{last['plan']['predicted_ms']:.0f} ms), booked {format_bytes(last['booked_bytes'])}"
        + (f", torch peak {format_bytes(out['vision_check']['torch_allocated_peak_bytes'])}" if cuda else ""))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    if eng.accel is not None:
        eng.accel.peak = eng.accel.total_used
    with VramPoller([os.getpid()], 0.01) as poll:
        t0 = time.perf_counter()
        first, tokens = None, []
        for ev in eng.generate(messages(), images=[image], max_new_tokens=args.new_tokens):
            if ev.token_id is None:
                continue
            if first is None:
                first = time.perf_counter() - t0
            tokens.append(ev.token_id)
        total = time.perf_counter() - t0
    stats = eng.stats()
    out.update(ttft_s=round(first, 3), total_s=round(total, 3), new_tokens=len(tokens),
               decode_tps=round((len(tokens) - 1) / (total - first), 3) if len(tokens) > 1 else None,
               tokens=tokens, warmup_tokens=warm, vision_ms=stats.get("vision_ms"),
               vision_predicted_ms=stats.get("vision_predicted_ms"), vision_where=stats.get("vision_where"),
               accounting_peak_bytes=eng.accel.peak if eng.accel is not None else 0,
               nvml_peak_bytes=poll.peak(os.getpid()) if poll.available else None)
    if cuda:
        out.update(torch_max_reserved_bytes=torch.cuda.max_memory_reserved(),
                   torch_max_allocated_bytes=torch.cuda.max_memory_allocated())
    rep = eng.plan_report()
    out["plan"] = {"budget": rep["budget"], "vision": rep["vision"]["last"]["plan"],
                   "lm_tier1": {k: rep["tiers"][0][k] for k in ("plan", "predicted_ms", "vram")},
                   "in_use_after": rep.get("in_use")}
    eng.close()
    say(f"slipstream: TTFT {out['ttft_s']:.2f} s, {len(tokens)} tokens in {total:.2f} s, accounting peak "
        f"{format_bytes(out['accounting_peak_bytes'])}, NVML peak {format_bytes(out['nvml_peak_bytes'] or 0)}")
    return out


def load_profile(args):
    """The GPU profile: the entry of --profile-db for this GPU where there is one, else measured."""
    if not args.device.startswith("cuda") or not args.profile_db or not Path(args.profile_db).is_file():
        return None
    import torch

    from engine.sharding.profile import ProfileDatabase

    name = torch.cuda.get_device_name(0)
    for entry in json.loads(Path(args.profile_db).read_text()).get("profiles", {}).values():
        if entry.get("fingerprint", {}).get("gpu") == name:
            say(f"profile: {args.profile_db} ({name}, {entry.get('created')})")
            return ProfileDatabase(entry)
    return None


# ---- transformers + accelerate --------------------------------------------------------------------

def _hf_model(folder: Path, gen_device: str):
    import torch
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    cfg = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration._from_config(cfg, dtype=torch.bfloat16)
    model = model.to_empty(device="cpu")
    from engine.loading.hf_vision import text_canonical_name, vision_canonical_name

    with torch.no_grad():
        for name, p in model.named_parameters():
            canon = vision_canonical_name(name) or text_canonical_name(name) or name
            seed_name = canon if canon.startswith("vision.") else name
            t = random_tensor(seed_name, tuple(p.shape) if canon != "vision.patch_embed.weight" else
                              (p.shape[0], p[0].numel()), gen_device, torch.bfloat16)
            p.copy_(t.reshape(p.shape).cpu())
        for name, b in model.named_buffers():
            if name.endswith("inv_freq"):      # to_empty left it uninitialised: recompute as the model does
                dim = b.numel() * 2
                theta = 10000.0 if "visual" in name else cfg.text_config.rope_parameters["rope_theta"]
                b.copy_(1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)))
    return model.eval()


def _hf_names(folder: Path) -> None:
    """Map the engine's text weight names to the HF names whose seeds draw them (the same values)."""
    import torch
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    from engine.loading.hf_vision import text_canonical_name

    cfg = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration._from_config(cfg, dtype=torch.bfloat16)
    for name, _ in model.named_parameters():
        canon = text_canonical_name(name)
        if canon:
            _HF_TEXT[canon] = name


def run_accelerate(args) -> dict:
    import inspect

    import torch

    from engine.bench.vram_poll import VramPoller
    from engine.loading.hf_vision import read_vl_config

    cuda = args.device.startswith("cuda")
    gen = "cuda" if cuda else "cpu"
    folder = Path(args.config_dir)
    _, vcfg = read_vl_config(folder)
    t0 = time.perf_counter()
    model = _hf_model(folder, gen)
    say(f"accelerate: model built on the CPU in {time.perf_counter() - t0:.0f} s")
    out: dict = {}
    device = torch.device("cpu")
    if cuda:
        from accelerate import dispatch_model, infer_auto_device_map

        torch.cuda.empty_cache()
        dm = infer_auto_device_map(model, max_memory={0: args.budget, "cpu": "200GiB"},
                                   no_split_module_classes=model._no_split_modules)
        dispatch_model(model, device_map=dm, main_device=0)
        device = torch.device("cuda", 0)
        on_gpu = [k for k, v in dm.items() if v == 0]
        out["device_map"] = {"modules_on_gpu": len(on_gpu), "modules": len(dm), "on_gpu": on_gpu[:40]}
        say(f"accelerate: {len(on_gpu)} of {len(dm)} modules on the GPU")
    tok = BenchTokenizer(model.config.text_config.vocab_size)
    takes_mm = "mm_token_type_ids" in inspect.signature(model.forward).parameters

    def gen_once(image, n: int, clock=None):
        ids, pixel_values, grids = prompt_inputs(vcfg, tok, image)
        input_ids = torch.tensor([ids], device=device)
        kw = {"mm_token_type_ids": (input_ids == SPECIALS["<|image_pad|>"]).long()} if takes_mm else {}
        with torch.no_grad():
            res = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 pixel_values=pixel_values.to(device), image_grid_thw=grids.to(device),
                                 max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                                 eos_token_id=None, streamer=clock, **kw)
        return ids, res[0, len(ids):].tolist()

    t0 = time.perf_counter()
    gen_once(picture(*WARMUP_IMAGE), 2)
    say(f"accelerate: warm-up (small image) in {time.perf_counter() - t0:.0f} s")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    clock = _FirstTokenClock()
    with VramPoller([os.getpid()], 0.01) as poll:
        t0 = time.perf_counter()
        clock.t0 = t0
        if poll.available:
            clock.peak = lambda: poll.peak(os.getpid())
        ids, tokens = gen_once(picture(*IMAGE_SIZE), args.new_tokens, clock)
        total = time.perf_counter() - t0
    first = clock.first - t0 if clock.first else None
    out.update(prompt_tokens=len(ids), ttft_s=round(first, 3) if first else None, total_s=round(total, 3),
               new_tokens=len(tokens), tokens=tokens,
               decode_tps=round((len(tokens) - 1) / (total - first), 3) if first and len(tokens) > 1 else None,
               nvml_peak_bytes=poll.peak(os.getpid()) if poll.available else None)
    if cuda:
        out.update(torch_max_reserved_bytes=torch.cuda.max_memory_reserved(),
                   torch_max_allocated_bytes=torch.cuda.max_memory_allocated())
    say(f"accelerate: TTFT {out['ttft_s']} s, {len(tokens)} tokens in {total:.1f} s, NVML peak "
        f"{format_bytes(out['nvml_peak_bytes'] or 0)}")
    return out


class _FirstTokenClock:
    """A streamer noting when the first generated token arrives (the first put is the prompt) and
    printing it at once, then every 8 tokens the tokens so far, their time and the NVML peak so far, so a
    run cut short by the time limit still reports what it measured."""

    def __init__(self):
        self.t0, self.first, self.puts = 0.0, None, 0
        self.peak = None            # () -> NVML peak bytes so far, where NVML is available

    def put(self, value) -> None:
        self.puts += 1
        now = time.perf_counter()
        if self.puts == 2:
            self.first = now
            print("RESULT-PARTIAL " + json.dumps({"ttft_s": round(self.first - self.t0, 3)}), flush=True)
        elif self.puts > 2 and self.puts % 8 == 0:
            n = self.puts - 1
            part = {"partial_tokens": n, "partial_elapsed_s": round(now - self.t0, 3),
                    "partial_decode_tps": round((n - 1) / (now - self.first), 3)}
            if self.peak is not None:
                part["nvml_peak_bytes"] = self.peak()
            print("RESULT-PARTIAL " + json.dumps(part), flush=True)
            say(f"accelerate: {n} tokens after {now - self.t0:.0f} s")

    def end(self) -> None:
        pass


# ---- the harness ----------------------------------------------------------------------------------

def run_part(args) -> None:
    fn = {"slipstream": run_slipstream, "accelerate": run_accelerate}[args.part]
    try:
        res = fn(args)
    except Exception as exc:  # noqa: BLE001 - reported as the system's result
        import traceback

        traceback.print_exc()
        res = {"error": f"{type(exc).__name__}: {exc}"}
    print("RESULT " + json.dumps(res), flush=True)


def spawn(part: str, args, limit_s: float) -> dict:
    """Run one system in a subprocess under a time limit; its last RESULT line (or what it got to)."""
    cmd = [sys.executable, "-m", "engine.bench.vlm_bench", "--part", part, "--device", args.device,
           "--shape", args.shape, "--budget", str(args.budget), "--new-tokens", str(args.new_tokens),
           "--config-dir", args.config_dir, "--profile-db", args.profile_db or ""]
    say(f"{part}: starting (limit {limit_s:.0f} s)")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    result, partial, tail = None, {}, []
    deadline = time.monotonic() + limit_s
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            proc.kill()
            say(f"{part}: time limit of {limit_s:.0f} s reached, stopped")
            break
        if not sel.select(timeout=min(left, 1.0)):
            if proc.poll() is not None:
                break
            continue
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        line = line.rstrip("\n")
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
        elif line.startswith("RESULT-PARTIAL "):
            partial.update(json.loads(line[len("RESULT-PARTIAL "):]))
        else:
            print(f"  {line}", flush=True)
            tail = (tail + [line])[-20:]
    proc.wait()
    if result is None:
        result = {**partial, "error": f"no result within {limit_s:.0f} s (exit {proc.returncode})",
                  "log_tail": tail}
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.bench.vlm_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda | sim | cpu")
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES), help="7b (default on cuda) or tiny")
    ap.add_argument("--budget", default="2.5GiB")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", default="docs/benchmarks/gpu")
    ap.add_argument("--skip-accelerate", action="store_true")
    ap.add_argument("--skip-slipstream", action="store_true")
    ap.add_argument("--slipstream-limit", type=float, default=180.0, help="seconds")
    ap.add_argument("--accelerate-limit", type=float, default=170.0, help="seconds")
    ap.add_argument("--profile-db", default="docs/benchmarks/profiles/h200.json")
    ap.add_argument("--part", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--config-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.shape = args.shape or ("7b" if args.device.startswith("cuda") else "tiny")
    args.budget = parse_bytes(args.budget, "--budget")
    if args.part:
        run_part(args)
        return 0
    command = "python -m engine.bench.vlm_bench " + " ".join(argv if argv is not None else sys.argv[1:])
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vlm-bench-") as tmp:
        args.config_dir = str(write_config(args.shape, Path(tmp) / f"qwen2_5_vl-{args.shape}"))
        results = {"slipstream": {"skipped": "--skip-slipstream"} if args.skip_slipstream
                   else spawn("slipstream", args, args.slipstream_limit)}
        if args.skip_accelerate:
            results["accelerate"] = {"skipped": "--skip-accelerate"}
        else:
            results["accelerate"] = spawn("accelerate", args, args.accelerate_limit)
    s, a = results["slipstream"], results["accelerate"]
    if s.get("tokens") and a.get("tokens"):
        same = next((i for i, (x, y) in enumerate(zip(s["tokens"], a["tokens"])) if x != y), min(len(s["tokens"]), len(a["tokens"])))
        results["same_first_tokens"] = same
    payload = {"benchmark": "vlm", "shape": f"Qwen2.5-VL-{args.shape}", "image": list(IMAGE_SIZE), "prompt": PROMPT,
               "device": args.device, "budget_bytes": args.budget, "new_tokens": args.new_tokens,
               "dtype": "bfloat16", "weights": "random (same seeds in both systems)", **results,
               "bench_wall_s": round(time.perf_counter() - t_start, 1)}
    from engine.bench.gpu_common import write_report

    path = write_report(Path(args.out), f"vlm_{args.shape}", payload, command)
    say(f"wrote {path}")
    print(table(payload))
    return 0


def table(p: dict) -> str:
    def gib(v):
        return f"{v / 2**30:.2f}" if isinstance(v, (int, float)) else "-"

    def num(v, fmt="{:.2f}"):
        return fmt.format(v) if isinstance(v, (int, float)) else "-"

    rows = [(f"{'system':<12} {'TTFT s':>8} {'total s':>8} {'tok':>4} {'dec t/s':>8} {'NVML GiB':>9} "
             f"{'torch GiB':>9} {'acct GiB':>9}  note")]
    for name in ("slipstream", "accelerate"):
        r = p.get(name, {})
        note = r.get("error") or r.get("skipped") or (f"vision {r.get('vision_where')} {num(r.get('vision_ms'), '{:.0f}')} ms"
                                                       if name == "slipstream" else "")
        rows.append(f"{name:<12} {num(r.get('ttft_s')):>8} {num(r.get('total_s')):>8} {r.get('new_tokens', '-'):>4} "
                    f"{num(r.get('decode_tps')):>8} {gib(r.get('nvml_peak_bytes')):>9} "
                    f"{gib(r.get('torch_max_reserved_bytes')):>9} {gib(r.get('accounting_peak_bytes')):>9}  {note}")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
