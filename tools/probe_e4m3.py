"""Whether torch.ldexp is exact on this device, and whether the spec's fp8 / nvfp4 quantisers give
the CPU's bytes on it (all 65536 bf16 values; a tie-heavy nvfp4 tensor). Prints one line each."""

import torch

from spec.ops import kv_storage as K

dev = "cuda"
e = torch.arange(-12, 9, dtype=torch.int32)
exact = torch.tensor([2.0 ** int(i) for i in e], dtype=torch.float32)
for d in ("cpu", dev):
    got = torch.ldexp(torch.ones(e.numel(), device=d), e.to(d).float()).cpu()
    print(f"ldexp on {d}: {int((got != exact).sum())} of {e.numel()} powers of two inexact")
x = torch.arange(0, 65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
a, b = K.fp8_quantize(x), K.fp8_quantize(x.to(dev)).cpu()
print("fp8_quantize all bf16 values, cuda vs cpu bytes differ:",
      int((a.view(torch.uint8) != b.view(torch.uint8)).sum()))
g = torch.Generator().manual_seed(3)
y = (torch.randint(-12, 13, (64, 256), generator=g).float() * 0.25).to(torch.bfloat16)
gs = torch.tensor(0.5)
pa, sa = K.nvfp4_quantize(y, gs)
pb, sb = K.nvfp4_quantize(y.to(dev), gs.to(dev))
print("nvfp4_quantize ties, cuda vs cpu: packed differ", int((pa != pb.cpu()).sum()), "scales differ",
      int((sa.view(torch.uint8) != sb.cpu().view(torch.uint8)).sum()))
