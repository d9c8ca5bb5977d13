"""Call O diagnostic: the one-token attention kernels on CUDA, float32 and bf16: the paged path's
dense._attend (exact context, no mask) against dense.attend_one_token over the exact and the padded
context; which SDPA backend each takes; max abs difference and bitwise equality."""
import torch

from engine.models import dense

torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    for heads, kvh, d, n, pad in ((4, 2, 16, 37, 64), (32, 8, 128, 300, 512), (32, 4, 128, 1000, 1024)):
        q = torch.randn(heads, 1, d, device="cuda", dtype=dtype)
        k = torch.randn(kvh, pad, d, device="cuda", dtype=dtype)
        v = torch.randn(kvh, pad, d, device="cuda", dtype=dtype)
        paged = dense._attend(q, k[:, :n], v[:, :n], None, heads != kvh)
        valid = torch.arange(pad, device="cuda") < n
        exact = dense.attend_one_token(q, k[:, :n].contiguous(), v[:, :n].contiguous(), valid[:n].contiguous())
        padded = dense.attend_one_token(q, k, v, valid)
        def cmp(a, b):
            return f"{(a.float() - b.float()).abs().max().item():.3g} {'==' if torch.equal(a, b) else '!='}"
        print(dtype, heads, kvh, d, n, pad, "| paged-exact", cmp(paged, exact), "| paged-padded", cmp(paged, padded),
              "| exact-padded", cmp(exact, padded))
