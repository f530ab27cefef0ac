"""K-quants (``q4_k_m``, ``q5_k_m``, ``q6_k``, ``q2_k``) by llama.cpp's own quantiser.

The K-quant formats and their per-tensor mixes ("_m": some tensors, such as parts of the attention
V and FFN down projections, one step higher) are defined by llama.cpp; notebookkit does not
re-implement them. ``llama-cpp-python`` exposes ``llama_model_quantize(input, output, params)``,
which reads the 16-bit GGUF notebookkit wrote and writes the K-quant file.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from notebookkit.export_forms import GGUF_TYPES

from .checks import ExportError

__all__ = ["require_llama_cpp", "install_llama_cpp", "quantize_with_llama_cpp", "LLAMA_CPP_HINT"]

LLAMA_CPP_HINT = (
    "Install it with `pip install llama-cpp-python` (it compiles llama.cpp: about 6 minutes on 2 cores; "
    "pip caches the wheel), or with the notebookkit extra: `pip install notebookkit[gguf]`. "
    "Without it, use quantization_method='q8_0' or 'q4_0', which notebookkit writes itself."
)


VERIFY_HINT = (
    "Install it with `pip install llama-cpp-python` (it compiles llama.cpp: about 6 minutes on 2 cores; "
    "pip caches the wheel), or export without the check (verify=False; the panel's 'reload and verify' box)."
)


def require_llama_cpp(methods: Sequence[str] = (), purpose: str = ""):
    """The ``llama_cpp`` module; raises saying how to get it when it is not installed. ``methods``: the
    K-quants that need its quantiser; or ``purpose``: what else needs it (the GGUF check)."""
    try:
        import llama_cpp
    except ImportError as exc:
        if purpose:
            raise ExportError(f"{purpose} loads the GGUF file in llama.cpp, and llama-cpp-python is not installed "
                              f"({exc}). {VERIFY_HINT}") from None
        raise ExportError(
            f"quantization_method {', '.join(methods)} is made by llama.cpp's quantiser, and llama-cpp-python "
            f"is not installed ({exc}). {LLAMA_CPP_HINT}"
        ) from None
    return llama_cpp


def install_llama_cpp(spec: str = "llama-cpp-python") -> bool:
    """``pip install llama-cpp-python`` into this kernel's environment when it is missing (Colab and Kaggle do not
    have it); returns whether it installed. pip compiles llama.cpp: several minutes on a free Colab, once per
    session. Raises :class:`ExportError` with pip's last lines and what to do instead when it cannot install."""
    if importlib.util.find_spec("llama_cpp") is not None:
        return False
    print(f"installing {spec} (pip compiles llama.cpp: several minutes) ...", flush=True)
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", spec], capture_output=True, text=True)
    importlib.invalidate_caches()
    if pip.returncode or importlib.util.find_spec("llama_cpp") is None:
        raise ExportError(
            f"{spec} could not be installed:\n{pip.stderr.strip()[-1500:]}\n\nWhat to do: install it yourself "
            "(prebuilt CPU wheels: `pip install llama-cpp-python --extra-index-url "
            "https://abetlen.github.io/llama-cpp-python/whl/cpu`), or export GGUF without the llama.cpp check "
            "(verify=False; the panel's 'reload and verify' box) in q8_0, q4_0 or f16, which notebookkit writes itself.")
    return True


def quantize_with_llama_cpp(source: Path, target: Path, method: str) -> None:
    """``llama_model_quantize(source -> target)`` with llama.cpp's file type for ``method``."""
    llama_cpp = require_llama_cpp([method])
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = GGUF_TYPES[method].llama_ftype
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    if status != 0 or not Path(target).is_file():
        raise ExportError(f"llama.cpp's quantiser failed for {method} (status {status}) on {source}.")
