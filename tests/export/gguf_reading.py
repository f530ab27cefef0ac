"""A GGUF file read back with the ``gguf`` package alone (no llama.cpp): its tensors by name, its metadata
values, and a tensor decoded to fp32 in PyTorch's axis order."""

from __future__ import annotations

import numpy as np


def read_gguf(path):
    """``(tensors by name, value)``: ``value(key)`` is a metadata field as a Python value (a list for arrays)."""
    import gguf

    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    fields = reader.fields

    def value(key):
        f = fields[key]
        if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
            if f.types[-1] == gguf.GGUFValueType.STRING:
                return [bytes(f.parts[i]).decode() for i in f.data]
            return [f.parts[i].tolist()[0] for i in f.data]
        if f.types[0] == gguf.GGUFValueType.STRING:
            return bytes(f.parts[f.data[0]]).decode()
        return f.parts[f.data[0]].tolist()[0]

    return tensors, value


def dense(t) -> np.ndarray:
    """Tensor ``t`` of :func:`read_gguf` decoded to fp32, in PyTorch's axis order (ggml lists the axes reversed)."""
    import gguf

    data = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.asarray(data, dtype=np.float32).reshape([int(s) for s in reversed(t.shape)])
