"""The benchmark's scenarios: which model shapes, budgets, prompt lengths and batch sizes run.

Real shapes run on the GPU machine with random weights made there; the dry-run set is tiny shapes with
byte-sized budgets, on the CPU ("sim" device), to exercise the harness logic anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.units import parse_bytes

BUDGETS = ("2GiB", "4GiB", "8GiB")
PROMPTS = (512, 4096)
BATCHES = (4, 16)
DECODE_TOKENS = 32


@dataclass(frozen=True)
class Scenario:
    model: str                 # the "model" of results.json rows
    kind: str                  # "dense" | "moe" | "vl"
    gguf_shape: str            # name for engine.bench.gguf_shapes
    layers: int | None = None  # fewer layers than the real model (said in `note`)
    note: str = ""
    later: bool = False        # listed, but runs only when asked for by name
    # llama.cpp rows: llama-bench's prompt lengths, and the tuned variants run when --tuned is not given
    # (None: llamacpp_plan.TUNED's default set). Every llama-bench run reloads the model, so the 31 GB MoE
    # shape runs fewer: no 4096-token prefill, only the variants that move experts (--n-cpu-moe), mmap first.
    llamacpp_prompts: tuple[int, ...] = PROMPTS
    llamacpp_tuned: tuple[str, ...] | None = None

    def engine_config(self):
        """The engine's ModelConfig of this shape (bf16), or raise if the engine does not know it."""
        from engine.bench.shapes import get_shape

        cfg = DRY_CONFIGS[self.model]() if self.model in DRY_CONFIGS else get_shape(self.model)
        return replace(cfg, num_layers=self.layers) if self.layers else cfg


SCENARIOS: dict[str, Scenario] = {
    "llama3-8b": Scenario("llama3-8b", "dense", "llama3-8b"),
    "qwen3-30b-a3b": Scenario("qwen3-30b-a3b", "moe", "qwen3-30b-a3b", layers=24,
                              note="24 of its 48 layers (half the weights: 31 GB in 16-bit)",
                              llamacpp_prompts=(512,), llamacpp_tuned=("attn-gpu", "nommap+attn-gpu")),
    # (its own part, `--part vl`: engine.bench.vl_runs; the engine parts skip it)
    "qwen2.5-vl-7b": Scenario("qwen2.5-vl-7b", "vl", "", note="a 2560x1440 image: --part vl", later=True),
}
DRY_SCENARIOS: dict[str, Scenario] = {
    "tiny-llama": Scenario("tiny-llama", "dense", "tiny-llama", note="dry run: tiny shape"),
    "tiny-moe": Scenario("tiny-moe", "moe", "tiny-moe", note="dry run: tiny MoE shape",
                         llamacpp_prompts=(512,), llamacpp_tuned=("attn-gpu", "nommap+attn-gpu")),
}
DRY_BUDGETS = ("1MiB", "2MiB", "4MiB")


def _tiny_llama():
    from engine.config import ModelConfig

    return ModelConfig(arch="llama", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=64, rope_theta=10000.0,
                       max_position_embeddings=8192, dtype="bfloat16")


def _tiny_moe():
    from engine.config import ModelConfig

    return ModelConfig(arch="qwen3_moe", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=64, rope_theta=1e6, qk_norm=True,
                       max_position_embeddings=8192, dtype="bfloat16", num_experts=8,
                       num_experts_per_tok=2, moe_intermediate_size=128)


DRY_CONFIGS = {"tiny-llama": _tiny_llama, "tiny-moe": _tiny_moe}


def pick(names: str | None, dry_run: bool) -> list[Scenario]:
    """Scenarios by comma-separated name; default: every one not marked `later` (dense first)."""
    table = DRY_SCENARIOS if dry_run else SCENARIOS
    if not names:
        return [s for s in table.values() if not s.later]
    out = []
    for n in names.split(","):
        if n not in table:
            raise SystemExit(f"--models: unknown scenario {n!r}; known: {', '.join(table)}")
        out.append(table[n])
    return out


def budgets(spec: str | None, dry_run: bool) -> list[tuple[str, int]]:
    names = spec.split(",") if spec else list(DRY_BUDGETS if dry_run else BUDGETS)
    return [(n, parse_bytes(n)) for n in names]
