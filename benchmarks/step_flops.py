"""The matmul work of one LoRA training step by activation plan, and the speed ceiling it sets against a peer.

    python benchmarks/step_flops.py                   # issue #34's rows: our plans against Unsloth's full recompute

On a GPU-bound step (the T4 emulation and the 8B rows: the profile of session 32 found the GPU busy 98-99% of the
step, 55% of it in GEMMs at about the card's rate), the ratio of two systems' steps is about the ratio of their
matmul work at equal efficiency. This counts that work for a dense decoder of ``L`` layers, ``N = B T`` tokens, with
LoRA of rank ``r`` on the projections ``(in_p, out_p)`` of a layer (``P = sum in_p out_p`` frozen base weights,
``R = sum r (in_p + out_p)`` adapter weights), the LM head ``H x V`` frozen, in multiply-adds times 2:

    forward      2 N (P + R)  +  attention 2 N T dq                       (causal: half of 4 N T dq)
    backward     2 N P  (dX only: frozen bases)  +  2 N sum r (2 out_p + 2 in_p)  +  2.5 x attention
                 (the LoRA backward: U = dY B, dX += U A, dA = U^T X, dB = dY^T (s X A^T) with s X A^T saved
                 by the forward, as kernels.lora_projection does; FlashAttention's backward is 5 matmuls to 2),
                 + 2 N r in_p where X A^T is made again in the backward: the down projection's (from the h
                 the backward rebuilds) and, in a layer whose parked e, g skip the recompute, gate's and up's;
                 less the first layer's q/k/v input gradient (its input, the frozen embeddings', needs none)
    LM head      4 N H V    (the fused cross-entropy: logits and dX chunk by chunk, no dW)
    recompute    per layer and mode: keep 0; recompute / offload the forward less the down projection (base and
                 adapter: the deferred MLP skips it); offload_mlp that less gate and up (parked); a system that
                 recomputes every layer whole (Unsloth's offloaded checkpointing): the whole forward.

The ceiling of a row is ``work(peer) / work(ours)``; a measured ratio below it is a loss of efficiency
(non-matmul kernels, the host, the link), above it the peer's. Norms, activations and the optimizer are left
out (a few percent of the step). Checked on the CPU against ``torch.utils.flop_counter`` on a tiny Llama for
every mode (``tests/benchmarks/test_step_flops.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from notebookkit.memory.shapes import ModelShape, model_shape  # noqa: E402

QKV, GATE_UP, DOWN = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("down_proj",)


@dataclass(frozen=True)
class StepWork:
    """FLOPs of one step by part (module docstring): the projections' (base and adapter) in the forward, the
    backward and the recompute, the attention's in all three, and the LM head's."""

    forward: float
    backward: float
    recompute: float
    attention: float
    lm_head: float

    @property
    def projections(self) -> float:
        return self.forward + self.backward + self.recompute

    @property
    def total(self) -> float:
        return self.projections + self.attention + self.lm_head


def _projections(shape: ModelShape, targets) -> dict[str, tuple[int, int]]:
    dims = shape.projection_shapes()
    return {name: dims[name] for name in targets} if targets is not None else dims


def layer_forward(shape: ModelShape, tokens: int, seq_len: int, r: int, targets=None, skip=()) -> tuple[float, float]:
    """``(linear and adapter FLOPs, attention FLOPs)`` of one layer's forward for ``tokens`` tokens, without the
    projections in ``skip`` (base and adapter)."""
    adapted = _projections(shape, targets)
    linear = sum(2 * tokens * i * o for name, (i, o) in shape.projection_shapes().items() if name not in skip)
    lora = sum(2 * tokens * r * (i + o) for name, (i, o) in adapted.items() if name not in skip)
    return linear + lora, 2 * tokens * seq_len * shape.q_dim


def step_work(shape: ModelShape, *, batch_size: int, seq_len: int, plan, r: int = 16, targets=None,
              recompute_whole: bool = False) -> StepWork:
    """The :class:`StepWork` of one step for ``plan`` (per-layer modes of ``notebookkit.memory``); with
    ``recompute_whole`` every non-kept layer reruns its whole forward (a peer's checkpointing)."""
    if shape.num_experts:
        raise ValueError("step_flops counts dense decoders; a mixture of experts is not modelled here.")
    N = batch_size * seq_len
    lin, attn = layer_forward(shape, N, seq_len, r, targets)
    adapted = _projections(shape, targets)
    lora_bwd = sum(2 * N * r * (2 * o + 2 * i) for i, o in adapted.values())

    def made_again(names) -> float:  # X A^T of these projections, made again in the backward
        return sum(2 * N * r * i for name, (i, o) in adapted.items() if name in names)

    base_bwd = sum(2 * N * i * o for i, o in shape.projection_shapes().values())
    # the first layer's input (the frozen embeddings' output) needs no gradient: no q/k/v input gradient there
    first = sum(2 * N * i * o for name, (i, o) in shape.projection_shapes().items() if name in QKV) + \
        sum(2 * N * r * i for name, (i, o) in adapted.items() if name in QKV)
    recompute = recomputed_attention = 0.0
    for mode in plan:
        if mode == "keep":
            continue
        skip = () if recompute_whole else DOWN + (GATE_UP if mode == "offload_mlp" else ())
        projections, attention = layer_forward(shape, N, seq_len, r, targets, skip)
        recompute, recomputed_attention = recompute + projections, recomputed_attention + attention
    L = len(plan)
    backward = L * (base_bwd + lora_bwd + made_again(DOWN)) + plan.count("offload_mlp") * made_again(GATE_UP) - first
    return StepWork(forward=L * lin, backward=backward, recompute=recompute,
                    attention=L * 3.5 * attn + recomputed_attention,
                    lm_head=4.0 * N * shape.hidden_size * shape.vocab_size)


#: issue #34's rows: (label, shape, batch, seq, our plan as (keep, offload, offload_mlp) counts or a layout, the
#: measured ratio against Unsloth and where it was measured)
ROWS = [
    ("8B NF4 4096x1 T4 emulation, auto (front)", "llama-3.1-8b", 1, 4096, ("front", 16, 7, 9),
     "1.16-1.18x (sessions 31-32)"),
    ("8B NF4 4096x1 T4 emulation, layout='spread'", "llama-3.1-8b", 1, 4096, ("spread", 16, 0, 16), "not measured"),
    ("8B NF4 4096x2 bf16, at <= Unsloth's peak", "llama-3.1-8b", 2, 4096, ("front", 0, 14, 18), "1.21x (session 32)"),
    ("8B NF4 4096x2 bf16, every layer parked", "llama-3.1-8b", 2, 4096, ("front", 0, 0, 32),
     "1.17x (session 28; the link falls behind)"),
    ("1B bf16 2048x8, at <= Unsloth's peak (all offloaded)", "llama-3.2-1b", 8, 2048, ("front", 0, 16, 0),
     "not measured"),
    ("1B bf16 2048x8, every layer parked (the H200's link carries about a third)", "llama-3.2-1b", 8, 2048,
     ("front", 0, 0, 16), "not measured"),
]


def plan_of(counts: tuple[str, int, int, int], layers: int) -> tuple[str, ...]:
    """Per-layer modes from ``(layout, keep, offload, offload_mlp)``: offloaded first (parked ones spread among them
    as the planner parks them), or spread among the kept layers."""
    from notebookkit.memory.planner import park_offloaded_mlps, spread_offloaded

    layout, keep, offload, parked = counts
    if keep + offload + parked != layers:
        raise ValueError(f"{counts} does not add up to {layers} layers.")
    front = ("offload",) * (offload + parked) + ("keep",) * keep
    front = park_offloaded_mlps(front, 1.0, most=parked) if parked else front
    return spread_offloaded(front) if layout == "spread" else front


def table(rows=ROWS) -> str:
    lines = ["| row | our plan | our TFLOP | Unsloth TFLOP (every layer recomputed) | ceiling | measured |",
             "|---|---|---:|---:|---:|---|"]
    for label, name, batch, seq, counts, measured in rows:
        shape = model_shape(name)
        plan = plan_of(counts, shape.num_layers)
        ours = step_work(shape, batch_size=batch, seq_len=seq, plan=plan)
        peer = step_work(shape, batch_size=batch, seq_len=seq, plan=("recompute",) * shape.num_layers,
                         recompute_whole=True)
        what = ", ".join(f"{n} {m}" for m, n in zip(("keep", "offload", "offload_mlp"), counts[1:]) if n)
        lines.append(f"| {label} | {what} ({counts[0]}) | {ours.total / 1e12:.1f} | {peer.total / 1e12:.1f} | "
                     f"{peer.total / ours.total:.2f}x | {measured} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(table())


if __name__ == "__main__":
    main()
