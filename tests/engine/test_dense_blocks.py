"""The attention block's fused path (one qkv matmul, the q/k norms and RoPE over the query and key heads at
once) computes what the separate q/k/v path computes (norms and RoPE per projection): bit for bit in 16-bit
(the native kernel's rows do not depend on the matrix's height), within float32 rounding in float32 (the
BLAS may block a taller matrix differently: the H200 host's did, session 8)."""

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
    if dtype == torch.float32:
        assert all(torch.allclose(s[t], f[t], rtol=1e-5, atol=1e-6) for t in "qkv")
        assert torch.allclose(out_sep, out_fused, rtol=1e-5, atol=1e-6)
    else:
        assert all(torch.equal(s[t], f[t]) for t in "qkv")
        assert torch.equal(out_sep, out_fused)
