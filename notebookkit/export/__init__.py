"""Exporters and their reload checks: the LoRA adapter, a merged 16-bit model, GGUF (+ Ollama Modelfile).

On a model from ``FastLanguageModel`` these are methods::

    model.save_pretrained_merged("out/merged", tokenizer, save_method="merged_16bit")
    model.save_pretrained_gguf("out/gguf", tokenizer, quantization_method=["q8_0", "q4_k_m"])
    model.push_to_hub_merged("me/my-model", tokenizer, token="hf_...")

and :mod:`notebookkit.export.verify` reloads what was written and compares it with the adapter model.
"""

from __future__ import annotations

from notebookkit._lazy import lazy_package

__getattr__, __dir__, __all__ = lazy_package(__name__, {
    "merged": ("save_pretrained_merged", "ExportResult", "SAVE_METHODS"),
    "gguf_file": ("save_pretrained_gguf", "GGUF_METHODS", "KQUANT_METHODS"),
    "kquants": ("install_llama_cpp",),
    "hub": ("push_to_hub_merged", "push_to_hub_gguf"),
    "checks": ("ExportError",),
    "bind": ("bind_export_methods",),
    "verify": ("check_merged_folder", "check_gguf_file"),
    "modelfile": ("write_modelfile",),
    "canary": ("train_canary", "DEFAULT_CANARY"),
    "report": ("export_and_verify",),
})
