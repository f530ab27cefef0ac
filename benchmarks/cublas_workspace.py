"""What PyTorch's cuBLAS workspaces add to ``torch.cuda.memory_allocated`` on this GPU (issue #35's memory term).

    python benchmarks/cublas_workspace.py     # the card, the three deltas (MiB) and the memory model's term

PyTorch keeps one cuBLAS workspace per (handle, stream) pair for the life of the process, allocated through its
caching allocator (so it counts in ``memory_allocated`` and in every measured peak): by its source 32 MiB on
sm_90 and ``4096 * 2 + 16 * 8`` KiB (8.125 MiB) elsewhere, unless ``CUBLAS_WORKSPACE_CONFIG`` says otherwise. A
training step has the default stream's; a decode step captured as a CUDA graph adds the capture stream's
(``notebookkit.models.generation.graph_runner.capture_stream``). This measures, in a fresh process:

* the first ``mm`` on the default stream, less its output;
* the first ``mm`` on a new stream, less its output;
* a capture of one ``mm`` on another new stream (the graph pool's block for its output included).

The memory model counts one workspace for the training stream and one for the decode graphs' capture stream
(:func:`notebookkit.memory.cards.cublas_workspace_bytes`): the first two deltas must equal it (exit 1 otherwise;
``tests/memory/test_cublas_workspace_gpu.py`` runs this in a fresh process). Session 46 on an H100: 32.000, 32.000
and 32.008 MiB.
"""

from __future__ import annotations

import sys

import torch

from notebookkit.memory.cards import cublas_workspace_bytes


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
    modelled = cublas_workspace_bytes((major, minor))
    measured = {"first mm": after_first - before - out_bytes,
                "first mm on a new stream": after_side - after_first - out_bytes}
    wrong = {what: delta for what, delta in measured.items() if delta != modelled}
    differs = ", ".join(f"{what} {delta / mib:.3f} MiB" for what, delta in wrong.items())
    print(f"memory model (notebookkit.memory.cards.cublas_workspace_bytes): {modelled / mib:.3f} MiB a stream: "
          + (f"differs from {differs}" if wrong else "matches"))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
