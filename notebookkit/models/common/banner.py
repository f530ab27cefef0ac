"""The short report printed when a model loads: versions, device and memory, dtype, fast-path features.

Every fast-path feature gets exactly one line saying whether it is on and why, so a notebook user
can tell at a glance what runs fused and what runs on stock Hugging Face / PEFT code.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from typing import Optional

import torch

from .precision import is_bfloat16_supported


@dataclass
class Banner:
    """Lines describing one loaded model. ``str(banner)`` renders it; ``show()`` prints it."""

    header: list[str] = field(default_factory=list)
    features: dict[str, tuple[bool, str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def feature(self, name: str, on: bool, why: str) -> None:
        """Record (or overwrite) the on/off line of one fast-path feature."""
        self.features[name] = (bool(on), why)

    def note(self, text: str) -> None:
        """Add a free-form line (fallbacks, warnings the user should see once)."""
        if text not in self.notes:
            self.notes.append(text)

    def is_on(self, name: str) -> bool:
        """True when the named feature is recorded as on."""
        return self.features.get(name, (False, ""))[0]

    def line(self, name: str) -> str:
        """The rendered ``[on ]`` / ``[off]`` line of one feature (``""`` when it is not recorded)."""
        if name not in self.features:
            return ""
        on, why = self.features[name]
        return f"[{'on ' if on else 'off'}] {name}  {why}"

    def render(self) -> str:
        width = max([len(k) for k in self.features] + [8])
        lines = ["==((====))==  notebookkit"]
        lines += [f"   {h}" for h in self.header]
        for name, (on, why) in self.features.items():
            lines.append(f"   [{'on ' if on else 'off'}] {name.ljust(width)}  {why}")
        lines += [f"   note: {n}" for n in self.notes]
        return "\n".join(lines)

    __str__ = render

    def show(self) -> None:
        """Print the banner."""
        print(self.render(), flush=True)


def _version(package: str) -> str:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:
        return "not installed"


def versions_line() -> str:
    """One line with the versions that matter for the fused path."""
    from notebookkit import __version__

    parts = [f"notebookkit {__version__}", f"torch {torch.__version__}"]
    for pkg in ("transformers", "peft", "trl", "triton", "bitsandbytes"):
        parts.append(f"{pkg} {_version(pkg)}")
    parts.append(f"python {platform.python_version()}")
    return " | ".join(parts)


def device_line(device: Optional[torch.device] = None) -> str:
    """One line naming the device and its memory."""
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        free, total = torch.cuda.mem_get_info(index)
        cap = f"sm_{props.major}{props.minor}"
        bf16 = "bf16 yes" if is_bfloat16_supported(index) else "bf16 no"
        return (
            f"GPU {index}: {props.name} ({cap}, {bf16}), {total / 2**30:.1f} GiB total, "
            f"{free / 2**30:.1f} GiB free"
        )
    try:
        import os

        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        mem = f", {pages / 2**30:.1f} GiB RAM"
    except (ValueError, OSError, AttributeError):
        mem = ""
    return f"CPU only ({torch.get_num_threads()} threads{mem}): kernels run their PyTorch references"


def get_banner(model) -> Optional[Banner]:
    """The banner attached to a loaded (possibly PEFT-wrapped) model, or ``None``."""
    seen = set()
    while model is not None and id(model) not in seen:
        seen.add(id(model))
        banner = model.__dict__.get("notebookkit_banner")
        if banner is not None:
            return banner
        if hasattr(model, "get_base_model"):
            inner = model.get_base_model()
        else:
            inner = model.__dict__.get("_modules", {}).get("model")
        if inner is model:
            break
        model = inner
    return None
