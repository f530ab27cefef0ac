"""What PyTorch's cuBLAS workspaces add to ``torch.cuda.memory_allocated`` on this GPU (issue #35's memory term).

    python benchmarks/cublas_workspace.py            # one line: the card and the three deltas, MiB

PyTorch keeps one cuBLAS workspace per (handle, stream) pair for the life of the process, allocated through its
caching allocator (so it counts in ``memory_allocated`` and in every measured peak): by its source 32 MiB on
sm_90 and ``4096 * 2 + 16 * 8`` KiB (8.125 MiB) elsewhere, unless ``CUBLAS_WORKSPACE_CONFIG`` says otherwise. A
training step has the default stream's; a decode step captured as a CUDA graph adds the capture stream's
(``notebookkit.models.generation.graph_runner.capture_stream``). This measures, in a fresh process:

* the first ``mm`` on the default stream, less its output;
* the first ``mm`` on a new stream, less its output;
* a capture of one ``mm`` on another new stream (the graph pool's block for its output included).

The memory model has no such term yet; these numbers size it.
"""

from __future__ import annotations

import sys

import torch


def main() -> int:
    if not torch.cuda.is_available():
        print("cublas_workspace.py measures a CUDA GPU's allocator; none is visible here.")
        return 2
    device = torch.device("cuda")
    mib = 2.0**20
    a = torch.randn(64, 64, device=device, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    first = a @ a
    torch.cuda.synchronize()
    after_first = torch.cuda.memory_allocated()
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        on_side = a @ a
    torch.cuda.synchronize()
    after_side = torch.cuda.memory_allocated()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream(device)):
        captured = a @ a
    torch.cuda.synchronize()
    after_capture = torch.cuda.memory_allocated()
    out_bytes = first.numel() * first.element_size()
    major, minor = torch.cuda.get_device_capability(device)
    print(f"{torch.cuda.get_device_name(device)} (sm_{major}{minor}), torch {torch.__version__}: "
          f"first mm +{(after_first - before - out_bytes) / mib:.3f} MiB; "
          f"first mm on a new stream +{(after_side - after_first - out_bytes) / mib:.3f} MiB; "
          f"a capture on another new stream +{(after_capture - after_side) / mib:.3f} MiB "
          f"(outputs {on_side.shape}, {captured.shape})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
