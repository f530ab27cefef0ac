"""Sub-4-bit frozen bases under LoRA (issue 33): the 2-bit and ternary linear layers, loading a model in
those formats from a 16-bit checkpoint (layer by layer), from a pre-quantised one, or from a BitNet
b1.58 checkpoint, and building a random-weight model directly in the 2-bit format.

* :mod:`.frozen_linear`: :class:`Q2Linear`, :class:`TernaryLinear` (what PEFT wraps with LoRA).
* :mod:`.flags`: which format ``from_pretrained``'s keywords and the checkpoint ask for, and the
  messages for the combinations that conflict.
* :mod:`.stream_load`: the load itself (skeleton without weights, then one tensor at a time).
"""

from .frozen_linear import LOW_BIT_LINEARS, Q2Linear, TernaryLinear, is_low_bit_linear

__all__ = ["Q2Linear", "TernaryLinear", "LOW_BIT_LINEARS", "is_low_bit_linear"]
