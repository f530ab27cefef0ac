"""Does torch's pinned host allocator reuse the staging block of .item() across a graph capture and its drop?"""
import torch
def st(): s = torch.cuda.host_memory_stats(); return s["num_host_alloc"], s["num_host_free"]
x = torch.ones(4, device="cuda")
print("start", st())
for i in range(3): x.sum().item()
print("3 items", st())
for rnd in range(3):
    g = torch.cuda.CUDAGraph(); s = torch.cuda.Stream()
    y = torch.zeros(4, device="cuda")
    with torch.cuda.graph(g, stream=s):
        y.add_(x)
    g.replay(); torch.cuda.synchronize()
    x.sum().item()
    print("after capture", rnd, st())
    del g; torch.cuda.synchronize()
    x.sum().item()
    print("after drop", rnd, st())
for rnd in range(3):
    z = torch.arange(10, device="cuda"); m = z > 3
    _ = z[m]   # index with a mask: nonzero's sync copy
    print("mask index", rnd, st())
