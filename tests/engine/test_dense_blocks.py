"""The attention block's fused path (one qkv matmul, the q/k norms and RoPE over the query and key heads at
once) computes bit for bit what the separate q/k/v path computes (norms and RoPE per projection)."""

import pytest
import torch

from engine.config import ModelConfig
from engine.models import dense


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 6])
@pytest.mark.parametrize("qk_norm", [False, True, "float32"])
def test_fused_qkv_path_matches_separate_projections(dtype, n, qk_norm):
    torch.manual_seed(n)
    h, heads, kv_heads, d = 128, 4, 2, 32
    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=h, intermediate_size=256, num_layers=1,
                      num_heads=heads, num_kv_heads=kv_heads, head_dim=d, qk_norm=bool(qk_norm),
                      dtype="float32" if dtype == torch.float32 else "bfloat16")
    sep = {"attn_norm.weight": torch.randn(h, dtype=dtype), "q.weight": torch.randn(heads * d, h, dtype=dtype) / 8,
           "k.weight": torch.randn(kv_heads * d, h, dtype=dtype) / 8, "v.weight": torch.randn(kv_heads * d, h, dtype=dtype) / 8,
           "o.weight": torch.randn(h, heads * d, dtype=dtype) / 8, "q_norm.weight": torch.randn(d, dtype=dtype),
           "k_norm.weight": torch.randn(d, dtype=dtype)}
    fused = dict(sep, **{"qkv.weight": torch.cat([sep["q.weight"], sep["k.weight"], sep["v.weight"]])})
    for name in ("q.weight", "k.weight", "v.weight"):
        del fused[name]
    if qk_norm == "float32":          # a GGUF file keeps its norms in F32 beside 16-bit matrices
        for w in (sep, fused):
            w["q_norm.weight"], w["k_norm.weight"] = sep["q_norm.weight"].float(), sep["k_norm.weight"].float()
    x = torch.randn(n, h, dtype=dtype)
    ang = torch.arange(3, 3 + n)[:, None].float() * torch.rand(d // 2)[None, :]
    cos, sin = (torch.cat([f(ang)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    past_k, past_v = torch.randn(kv_heads, 3, d, dtype=dtype), torch.randn(kv_heads, 3, d, dtype=dtype)
    results = []
    for w in (sep, fused):
        seen = {}

        def attend(q, k, v, seen=seen):
            seen.update(q=q, k=k, v=v)
            return dense._attend(q, torch.cat([past_k, k], 1), torch.cat([past_v, v], 1),
                                 dense.attention_mask(n, 3, None, "cpu"), True)

        results.append((dense.attention_block(cfg, w, x, cos, sin, None, None, None, attend=attend), seen))
    (out_sep, s), (out_fused, f) = results
    assert all(torch.equal(s[t], f[t]) for t in "qkv")
    assert torch.equal(out_sep, out_fused)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 4096), (1, 40, 128), (7, 576)])
def test_one_call_norm_rounds_as_the_stepwise_norm(dtype, shape):
    """The GPU's norm is one PyTorch call (`dense._normed`, then the weight): it rounds where the stepwise
    norm does, so results are equal but for the last bit of a few elements (the order of the sum of
    squares may differ). On the GPU machine (SLIPSTREAM_TEST_DEVICE=cuda) through `rms_norm` and the q/k
    norms themselves; here the same call on the CPU."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 3).to(dtype).to(dev)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype).to(dev)
    x32 = x.float()
    want = w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    got = dense.rms_norm(x, w, 1e-6) if dev == "cuda" else w * dense._normed(x, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    ulp = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    rel = (got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-3)
    assert rel.max().item() <= 2.01 * ulp
    assert (got != want).float().mean().item() <= 0.02
    if dev == "cuda" and len(shape) == 3:         # the q/k norms: two weights by head
        cfg = ModelConfig(arch="qwen3", vocab_size=8, hidden_size=shape[-1] * 32, intermediate_size=8,
                          num_layers=1, num_heads=shape[1] - 8, num_kv_heads=8, head_dim=shape[-1], qk_norm=True)
        nh = cfg.num_heads
        qk = dense._qk_normed(cfg, {"q_norm.weight": w, "k_norm.weight": w.flip(0)}, x)
        ref = torch.cat([dense.rms_norm(x[:, :nh], w, cfg.rms_norm_eps),
                         dense.rms_norm(x[:, nh:], w.flip(0), cfg.rms_norm_eps)], 1)
        assert torch.equal(qk, ref)
