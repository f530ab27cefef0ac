"""Exporters (LoRA adapter, merged 16-bit, GGUF) and their reload checks: built by the export issue."""
