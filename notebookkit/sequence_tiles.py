"""How many tokens one tile of a sequence-tiled MLP holds: the rule the kernel and the memory model share.

A gated MLP's intermediates (``e = gate(X)``, ``g = up(X)``, ``h = act(e) * g`` and their gradients) are
``[N, I]`` each: at 131,072 tokens of an 8B model (``I = 14,336``) 3.5 GiB per tensor. The MLP acts on each
token alone, so it can run over the tokens a tile at a time with the same result: the no-grad forward
(an offloaded layer's first pass, a reference pass) and the backward of a recomputed layer
(:mod:`notebookkit.kernels.lora_mlp`) then hold a few ``[rows, I]`` tiles instead of whole ``[N, I]``
tensors. A tile is as many rows as fit :data:`MLP_TILE_BYTES` in one intermediate, a multiple of
:data:`MLP_TILE_ALIGN` rows (whole GEMM tiles), and never fewer than :data:`MLP_TILE_MIN_ROWS`, so that
its products stay large enough to run at full speed; a batch of at most that many tokens is one tile.
"""

from __future__ import annotations

__all__ = ["MLP_TILE_BYTES", "MLP_TILE_ALIGN", "MLP_TILE_MIN_ROWS", "mlp_tile_rows"]

#: bytes of one ``[rows, I]`` intermediate of one tile
MLP_TILE_BYTES = 256 * 2**20
#: a tile's rows are a multiple of this
MLP_TILE_ALIGN = 256
#: the fewest rows a tile has (its GEMMs stay compute-bound)
MLP_TILE_MIN_ROWS = 4096


def mlp_tile_rows(intermediate_size: int, itemsize: int) -> int:
    """Tokens per tile of an MLP of ``intermediate_size`` in a compute dtype of ``itemsize`` bytes:
    ``max(MIN_ROWS, floor(TILE_BYTES / (I * itemsize)) rounded down to ALIGN)`` (9,216 for an 8B model in bf16)."""
    if intermediate_size < 1 or itemsize < 1:
        raise ValueError(f"mlp_tile_rows: intermediate_size and itemsize must be >= 1 "
                         f"(got {intermediate_size}, {itemsize}).")
    rows = MLP_TILE_BYTES // (intermediate_size * itemsize) // MLP_TILE_ALIGN * MLP_TILE_ALIGN
    return max(MLP_TILE_MIN_ROWS, rows)
