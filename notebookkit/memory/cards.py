"""GPU cards and memory sizes: parse ``"t4"``, ``"a100-40gb"``, ``"16GB"``, ``"16 GiB"``.

A :class:`GPUCard` carries what the memory model and the planner need: usable memory (what
``torch.cuda.get_device_properties().total_memory`` reports, a little under the marketed size),
whether it does bf16, a realistic dense fp16/bf16 matmul rate for the planner's cost model, and
the host link bandwidth used to price offloading.

Units follow the convention of ``accelerate``'s ``max_memory``: ``GB``/``MB`` are powers of ten,
``GiB``/``MiB`` powers of two. A bare number is bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GiB = 1024**3
MiB = 1024**2
KiB = 1024


def cublas_workspace_bytes(compute_capability: tuple[int, int]) -> int:
    """PyTorch's cuBLAS workspace for one (handle, stream) pair on a card of ``compute_capability``.

    PyTorch allocates it through its caching allocator at the first matmul on a stream and keeps it for the life
    of the process, so it counts in ``torch.cuda.max_memory_allocated`` and in every measured peak: 32 MiB on sm_90
    (``benchmarks/cublas_workspace.py`` on an H100, session 46: +32.00 MiB for the first ``mm`` on a stream),
    ``4096 * 2 + 16 * 8`` KiB (8.125 MiB) on the other cards, by PyTorch's source. ``CUBLAS_WORKSPACE_CONFIG``
    changes it; that is not modelled.
    """
    if tuple(compute_capability)[:1] == (9,):
        return 32 * MiB
    return (4096 * 2 + 16 * 8) * KiB


# Where no card is known (the estimate's default): every card but sm_90's, a T4's among them.
DEFAULT_CUBLAS_WORKSPACE_BYTES = cublas_workspace_bytes((7, 5))


@dataclass(frozen=True)
class GPUCard:
    """One GPU model as the planner sees it."""

    key: str
    name: str
    memory_bytes: int
    bf16: bool
    tflops: float  # realistic dense 16-bit matmul rate, TFLOP/s
    pcie_gbps: float  # host <-> device copy bandwidth, GB/s (pinned memory)
    compute_capability: tuple[int, int] = (0, 0)

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GiB

    def label(self) -> str:
        return f"{self.name} ({self.memory_gib:.1f} GiB)"

    @property
    def cublas_workspace_bytes(self) -> int:
        """One stream's cuBLAS workspace on this card (:func:`cublas_workspace_bytes`)."""
        return cublas_workspace_bytes(self.compute_capability)


CARDS: dict[str, GPUCard] = {
    c.key: c
    for c in [
        GPUCard("t4", "Tesla T4 16GB", 15100 * MiB, False, 25.0, 11.0, (7, 5)),
        GPUCard("p100", "Tesla P100 16GB", 16280 * MiB, False, 9.0, 11.0, (6, 0)),
        GPUCard("v100-16gb", "Tesla V100 16GB", 16160 * MiB, False, 80.0, 11.0, (7, 0)),
        GPUCard("l4", "NVIDIA L4 24GB", 23034 * MiB, True, 80.0, 22.0, (8, 9)),
        GPUCard("a10g", "NVIDIA A10G 24GB", 22600 * MiB, True, 60.0, 22.0, (8, 6)),
        GPUCard("rtx3090", "GeForce RTX 3090 24GB", 24260 * MiB, True, 60.0, 22.0, (8, 6)),
        GPUCard("rtx4090", "GeForce RTX 4090 24GB", 24210 * MiB, True, 140.0, 22.0, (8, 9)),
        GPUCard("a100-40gb", "NVIDIA A100 40GB", 40536 * MiB, True, 230.0, 22.0, (8, 0)),
        GPUCard("a100-80gb", "NVIDIA A100 80GB", 81100 * MiB, True, 230.0, 22.0, (8, 0)),
        GPUCard("h100", "NVIDIA H100 80GB", 81000 * MiB, True, 600.0, 45.0, (9, 0)),
        GPUCard("h200", "NVIDIA H200 141GB", 143000 * MiB, True, 750.0, 55.0, (9, 0)),  # link: measured, 2026-11-29
    ]
}

_ALIASES = {
    "t4": "t4", "teslat4": "t4", "colab": "t4", "kaggle": "t4",
    "p100": "p100", "teslap100": "p100",
    "v100": "v100-16gb", "v10016": "v100-16gb",
    "l4": "l4",
    "a10g": "a10g", "a10": "a10g",
    "3090": "rtx3090", "rtx3090": "rtx3090",
    "4090": "rtx4090", "rtx4090": "rtx4090",
    "a10040": "a100-40gb", "a100sxm440": "a100-40gb", "a100pcie40": "a100-40gb",
    "a10080": "a100-80gb", "a100sxm480": "a100-80gb", "a100pcie80": "a100-80gb",
    "h100": "h100", "h10080": "h100", "h100sxm5": "h100", "h100sxm": "h100", "h100pcie": "h100",
    "h200": "h200", "h200141": "h200", "h200sxm": "h200",
}


def _norm(name: str) -> str:
    s = name.lower()
    for word in ("nvidia", "tesla", "geforce", "gpu"):
        s = s.replace(word, "")
    s = re.sub(r"(\d)\s*gi?b\b", r"\1", s)
    return re.sub(r"[^a-z0-9]", "", s)


def parse_card(name: str) -> GPUCard:
    """Look up a card by a loose name: ``"t4"``, ``"T4"``, ``"a100-40gb"``, ``"A100 80GB"``,
    ``"NVIDIA A100-SXM4-40GB"``, ``"h200"``. Raises ``ValueError`` listing the known cards."""
    key = _norm(name)
    if key in CARDS:
        return CARDS[key]
    if key in _ALIASES:
        return CARDS[_ALIASES[key]]
    if key == "a100":
        raise ValueError(
            f"notebookkit: {name!r} is ambiguous: say 'a100-40gb' or 'a100-80gb'."
        )
    raise ValueError(
        f"notebookkit: unknown GPU card {name!r}. Known cards: {', '.join(CARDS)}; or give a size such as "
        "'16GB' or '22.5 GiB'."
    )


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10, "ki": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20, "mi": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30, "gi": 2**30,
    "t": 10**12, "tb": 10**12, "tib": 2**40, "ti": 2**40,
}


def parse_memory(value: int | float | str) -> int:
    """Bytes from ``16_000_000_000``, ``"16GB"`` (10**9), ``"16 GiB"`` (2**30), ``"512MiB"``, or a card
    name (``"t4"``: that card's usable memory).

    A bare string number without a unit is refused, since "16" could mean GB or GiB.
    """
    if isinstance(value, bool):
        raise TypeError("notebookkit: a memory size cannot be True/False")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"notebookkit: memory size must be positive, got {value}")
        return int(value)
    text = str(value).strip()
    m = _SIZE.match(text)
    if m:
        number, unit = float(m.group(1)), m.group(2).lower()
        if unit == "" and _norm(text) in _ALIASES:
            return parse_card(text).memory_bytes
        if unit == "":
            raise ValueError(
                f"notebookkit: {value!r} has no unit: write '{text}GB' (10**9 bytes) or '{text}GiB' (2**30 bytes)."
            )
        if unit not in _UNITS:
            raise ValueError(f"notebookkit: cannot read memory size {value!r}; write e.g. '16GB' or '16GiB'.")
        return int(number * _UNITS[unit])
    return parse_card(text).memory_bytes


def detect_card(device: int | None = None) -> GPUCard | None:
    """The CUDA card this process sees, as a :class:`GPUCard` (None without a GPU).

    Known models get their table entry with the real total memory; unknown ones a generic entry.
    """
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        idx = torch.cuda.current_device() if device is None else device
        props = torch.cuda.get_device_properties(idx)
    except Exception:
        return None
    total = int(props.total_memory)
    cc = (int(props.major), int(props.minor))
    base: GPUCard | None = None
    try:
        base = parse_card(props.name)
    except ValueError:
        norm = _norm(props.name)
        for alias, key in sorted(_ALIASES.items(), key=lambda kv: -len(kv[0])):
            if alias in norm and not alias.isdigit():
                base = CARDS[key]
                break
    if base is not None:
        return GPUCard(base.key, props.name, total, base.bf16, base.tflops, base.pcie_gbps, cc)
    return GPUCard("detected", props.name, total, cc >= (8, 0), 50.0, 11.0, cc)
