"""Exporters and their reload checks: the LoRA adapter, a merged 16-bit model, GGUF (+ Ollama Modelfile).

On a model from ``FastLanguageModel`` these are methods::

    model.save_pretrained_merged("out/merged", tokenizer, save_method="merged_16bit")
    model.save_pretrained_gguf("out/gguf", tokenizer, quantization_method=["q8_0", "q4_k_m"])
    model.push_to_hub_merged("me/my-model", tokenizer, token="hf_...")

and :mod:`notebookkit.export.verify` reloads what was written and compares it with the adapter model.
"""

from __future__ import annotations

from notebookkit._lazy import lazy_exports

_LAZY = {
    "save_pretrained_merged": "merged",
    "ExportResult": "merged",
    "SAVE_METHODS": "merged",
    "save_pretrained_gguf": "gguf_file",
    "GGUF_METHODS": "gguf_file",
    "KQUANT_METHODS": "gguf_file",
    "install_llama_cpp": "kquants",
    "push_to_hub_merged": "hub",
    "push_to_hub_gguf": "hub",
    "ExportError": "checks",
    "bind_export_methods": "bind",
    "check_merged_folder": "verify",
    "check_gguf_file": "verify",
    "write_modelfile": "modelfile",
    "train_canary": "canary",
    "DEFAULT_CANARY": "canary",
    "export_and_verify": "report",
}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
__all__ = list(_LAZY)
