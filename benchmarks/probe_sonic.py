import sys, time
import torch
t0 = time.time()
from moekit.bench import bench_ms
from moekit.bench.baselines import sonicmoe_block
blk = sonicmoe_block(2880, 2880, 32, 4, "cuda")
print("import+build", blk is not None, f"{time.time() - t0:.1f}s", flush=True)
x = torch.randn(24576, 2880, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn_like(x)
ps = [x, *blk.parameters()]
t1 = time.time(); y = blk(x); torch.cuda.synchronize(); print("first fwd", f"{time.time() - t1:.1f}s", flush=True)
t1 = time.time(); torch.autograd.grad(blk(x), ps, dy); torch.cuda.synchronize(); print("first step", f"{time.time() - t1:.1f}s", flush=True)
f = bench_ms(lambda: blk(x)); s = bench_ms(lambda: torch.autograd.grad(blk(x), ps, dy))
print(f"sonicmoe gpt-oss-20b block: fwd {f:.2f} ms, bwd {s - f:.2f} ms, total {s:.2f} ms", flush=True)
