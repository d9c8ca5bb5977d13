"""The physical bound: the fastest any placement could run a shape in a VRAM budget on a measured machine.

From PIPELINED_SHARDING.md, with the profile's measured rates:
- decode of one sequence moves every weight byte it reads once per token. Bytes kept in the budget
  (after the KV cache) are read from VRAM; the rest cross either the CPU's DRAM (computed there) or
  PCIe (streamed), both at once at best: t = off / (BW_cpu + BW_pcie) + resident / BW_hbm. MoE reads
  only the routed experts (k / E of them) besides attention, router and head; the budget keeps what
  every token reads first (attention, head, router), then experts.
- prefill of T tokens in one pass: every byte not in VRAM either crosses PCIe once (and its FLOPs run on
  the GPU) or is computed on the CPU (at the CPU's best matmul rate, 2 T FLOPs per weight; a MoE expert's
  weight 2 T k / E), both at once: for a dense model t = max(off / (BW_pcie + CPU FLOP/s x dtype bytes /
  2T), FLOPs / GPU FLOP/s); tokens/s = T / t. (Before session 8 experts were priced as dense weights on
  the CPU, which put the MoE shape's 512-token bound below llama.cpp's measured rate.)
BW_cpu and BW_pcie are the rates measured *together* (`cpu_gemv_with_copy_gbps`, `h2d_with_cpu_gbps`);
the bound with the rates measured alone is reported beside it. So is the bound with transfer coding
(`engine.sharding.transfer_code`, the `*_coded` fields): PCIe then carries `coded_fraction` of each streamed
weight's bytes, so it delivers BW_pcie / coded_fraction of weights; a run that streams coded weights can
pass the plain bound, not this one.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.bench.gguf_shapes import GgufShape


@dataclass(frozen=True)
class Rates:
    cpu_gbps: float           # CPU weight streaming while PCIe copies run
    pcie_gbps: float          # host -> GPU while the CPU computes
    cpu_alone_gbps: float
    pcie_alone_gbps: float
    hbm_gbps: float
    gpu_tflops: float         # best measured bf16 GEMM rate
    cpu_tflops: float = 0.0   # best measured CPU bf16 GEMM rate

    @classmethod
    def from_profile(cls, prof: dict) -> Rates:
        link, gpu = prof["link"], prof["gpu"]
        best = max(r for rows in gpu["gemm"].get("bfloat16", gpu["gemm"][next(iter(gpu["gemm"]))]).values()
                   for _, r in rows)
        cpu = prof.get("cpu", {}).get("gemm", {})
        cpu_best = max((r for rows in cpu.get("bfloat16", {}).values() for _, r in rows), default=0.0)
        return cls(cpu_gbps=link["cpu_gemv_with_copy_gbps"], pcie_gbps=link["h2d_with_cpu_gbps"],
                   cpu_alone_gbps=link["cpu_gemv_gbps"], pcie_alone_gbps=link["h2d_gbps"],
                   hbm_gbps=gpu["mem_gbps"], gpu_tflops=best / 1e3, cpu_tflops=cpu_best / 1e3)


@dataclass(frozen=True)
class ShapeBytes:
    always: int               # read by every token: attention, norms, router, output head (+ embed row)
    experts: int              # MoE expert bytes (0 for dense: the FFNs count in `always`)
    active_fraction: float    # experts used / experts total (1 for dense)
    kv_per_token: int
    flops_per_token: int      # 2 x active parameters (matmuls)
    attn_flops_per_token_ctx: int

    @property
    def total(self) -> int:
        return self.always + self.experts


def shape_bytes(shape: GgufShape, dtype_bytes: int = 2) -> ShapeBytes:
    wb = shape.weight_bytes(dtype_bytes)
    n = shape.layers
    kv = n * 2 * shape.kv_heads * shape.head_dim * dtype_bytes
    attn_flops = n * 4 * shape.heads * shape.head_dim
    if shape.is_moe:
        per_layer_experts = wb["layer_ffn"] - 4 * shape.experts * shape.hidden - 4 * shape.hidden
        experts = n * per_layer_experts
        always = n * (wb["layer"] - per_layer_experts) + wb["output"]
        frac = shape.experts_used / shape.experts
        active = always + frac * experts
    else:
        experts, always, frac = 0, n * wb["layer"] + wb["output"], 1.0
        active = always
    return ShapeBytes(always, experts, frac, kv, int(2 * active / dtype_bytes), attn_flops)


CODED_FRACTION = 0.753     # bytes over PCIe per weight byte with transfer coding (bf16 at a trained or
                           # random model's spread; measured on the suite's weights: 0.7529, session 23 call BC)


def decode_bound_tps(sb: ShapeBytes, budget: int, rates: Rates, ctx: int = 4096, alone: bool = False,
                     coded_fraction: float = 1.0) -> float:
    room = max(0, budget - sb.kv_per_token * ctx)
    res_always = min(sb.always, room)
    res_experts = min(sb.experts, room - res_always)
    read_res = res_always + sb.active_fraction * res_experts
    read_off = (sb.always - res_always) + sb.active_fraction * (sb.experts - res_experts)
    bw = (rates.cpu_alone_gbps + rates.pcie_alone_gbps / coded_fraction) if alone else \
        (rates.cpu_gbps + rates.pcie_gbps / coded_fraction)
    t = read_off / (bw * 1e9) + read_res / (rates.hbm_gbps * 1e9)
    return 1.0 / t if t > 0 else float("inf")


def prefill_bound_tps(sb: ShapeBytes, budget: int, rates: Rates, tokens: int, alone: bool = False,
                      coded_fraction: float = 1.0) -> float:
    """Every byte off the GPU crosses PCIe once or is computed on the CPU, both at once. The budget keeps
    the bytes every token reads first (on the CPU they cost 2T FLOPs each), then experts; the CPU takes
    experts first, as a token uses only `active_fraction` of them (2T x that fraction FLOPs per weight:
    a 512-token MoE pass computes 16x fewer expert FLOPs than a dense one of the same bytes)."""
    room = max(0, budget - sb.kv_per_token * tokens)
    res_always = min(sb.always, room)
    off_always = sb.always - res_always
    off_experts = max(0, sb.experts - (room - res_always))
    pcie = (rates.pcie_alone_gbps if alone else rates.pcie_gbps) * 1e9 / coded_fraction
    cpu_always = rates.cpu_tflops * 1e12 * 2 / (2 * tokens)            # bytes/s: 16-bit weights, 2T FLOPs each
    cpu_experts = cpu_always / sb.active_fraction if sb.experts else 0.0

    def off_in(t: float) -> bool:             # can PCIe and the CPU together take every off byte in t s?
        on_cpu_e = min(off_experts, cpu_experts * t)
        t_left = t - (on_cpu_e / cpu_experts if cpu_experts else 0.0)
        on_cpu_a = min(off_always, cpu_always * t_left)
        return off_experts - on_cpu_e + off_always - on_cpu_a <= pcie * t * (1 + 1e-12)

    lo, hi = 0.0, (off_always + off_experts) / pcie if pcie else float("inf")
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if off_in(mid) else (mid, hi)
    flops = sb.flops_per_token * tokens + sb.attn_flops_per_token_ctx * tokens * tokens / 2
    t = max(hi, flops / (rates.gpu_tflops * 1e12))
    return tokens / t


def bound_row(model: str, shape: GgufShape, budget_name: str, budget: int, rates: Rates,
              prompts=(512, 4096), profile_note: str = "") -> dict:
    sb = shape_bytes(shape)
    row = {"system": "bound", "model": model, "budget": budget_name, "budget_bytes": budget,
           "peak_vram_bytes": budget, "command": "engine.bench.bound (computed from the profile)",
           "decode_tps": decode_bound_tps(sb, budget, rates),
           "decode_tps_rates_alone": decode_bound_tps(sb, budget, rates, alone=True),
           "decode_tps_coded": decode_bound_tps(sb, budget, rates, coded_fraction=CODED_FRACTION),
           "coded_fraction": CODED_FRACTION,
           "model_bytes": sb.total,
           "note": "physical bound, not a run: the budget holds weights after the KV cache; "
                   f"CPU {rates.cpu_gbps:.0f} + PCIe {rates.pcie_gbps:.0f} GB/s together" + profile_note}
    for p in prompts:
        row[f"prefill{p}_tps"] = prefill_bound_tps(sb, budget, rates, p)
        row[f"prefill{p}_tps_rates_alone"] = prefill_bound_tps(sb, budget, rates, p, alone=True)
        row[f"prefill{p}_tps_coded"] = prefill_bound_tps(sb, budget, rates, p, coded_fraction=CODED_FRACTION)
    return row
