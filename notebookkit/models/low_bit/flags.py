"""Which base format a ``from_pretrained`` call loads: its keywords and the checkpoint decide.

* ``load_in_2bit=True`` / ``load_in_ternary=True`` (the ``load_flag`` of the 2-bit and ternary rows of
  :data:`notebookkit.base_formats.BASE_FORMATS`): quantise a 16-bit checkpoint layer by layer on load;
* a checkpoint saved by notebookkit in one of them (``config.json`` has :data:`CONFIG_KEY`): loads as
  saved, in its own format;
* a BitNet b1.58 checkpoint (``quantization_config.quant_method == "bitnet"``): loads as a ternary base.

:func:`check_flag_conflicts` refuses what cannot be honoured, with what to change: both low-bit flags,
one of them with an explicit ``load_in_4bit=True`` or ``load_in_8bit=True``, with
``full_finetuning=True`` (the base is frozen in those formats), or a flag that asks for another format
than the checkpoint's own.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from notebookkit.base_formats import BASE_FORMATS, PREQUANTISED_CONFIG_KEY

__all__ = ["CONFIG_KEY", "LOW_BIT_FORMATS", "check_flag_conflicts", "saved_low_bit_record", "is_bitnet_config",
           "format_to_load"]

#: the ``config.json`` entry of a checkpoint saved in a low-bit format (``notebookkit.base_formats``)
CONFIG_KEY = PREQUANTISED_CONFIG_KEY
LOW_BIT_FORMATS = ("2bit", "ternary")
_FLAGS = {BASE_FORMATS[name].load_flag: name for name in LOW_BIT_FORMATS}  # load_in_2bit -> "2bit", ...


def _asked(given: Mapping[str, Any]) -> list[str]:
    return [flag for flag in _FLAGS if given.get(flag)]


def check_flag_conflicts(given: Mapping[str, Any], where: str = "from_pretrained") -> None:
    """Raise a ValueError when the keywords the user passed (``given``: only those passed) ask for two
    base formats at once, or a low-bit base with full fine-tuning."""
    asked = _asked(given)
    if len(asked) > 1:
        raise ValueError(f"{where}: {' and '.join(f'{f}=True' for f in asked)} ask for two base formats at once. "
                         "Pass one of them: load_in_2bit=True (2.5 bits a weight, groups of 64) or "
                         "load_in_ternary=True (weights in {-1, 0, +1} times a scale a row).")
    if not asked:
        return
    flag = asked[0]
    for other in ("load_in_4bit", "load_in_8bit"):
        if given.get(other):
            raise ValueError(f"{where}: {flag}=True and {other}=True ask for two base formats at once. Drop "
                             f"{other}=True (or pass {other}=False) to load a {BASE_FORMATS[_FLAGS[flag]].label} "
                             f"base, or drop {flag}=True to load in {'NF4' if other == 'load_in_4bit' else '8-bit'}.")
    if given.get("full_finetuning"):
        raise ValueError(f"{where}: {flag}=True keeps the base weights frozen in a packed format, but "
                         "full_finetuning=True trains every weight. Drop full_finetuning=True to train LoRA "
                         f"adapters on the {BASE_FORMATS[_FLAGS[flag]].label} base, or drop {flag}=True to fine-tune "
                         "a 16-bit model.")


def saved_low_bit_record(config: Any) -> Optional[dict]:
    """The low-bit record a notebookkit-saved checkpoint's config carries (:data:`CONFIG_KEY`), or ``None``."""
    record = getattr(config, CONFIG_KEY, None)
    return dict(record) if isinstance(record, Mapping) else None


def is_bitnet_config(config: Any) -> bool:
    """True for a BitNet b1.58 checkpoint as transformers describes it (``quant_method: "bitnet"``)."""
    q = getattr(config, "quantization_config", None)
    method = q.get("quant_method") if isinstance(q, Mapping) else getattr(q, "quant_method", None)
    return getattr(method, "value", method) == "bitnet"


def format_to_load(config: Any, load_in_2bit: bool = False, load_in_ternary: bool = False,
                   where: str = "from_pretrained") -> Optional[str]:
    """``"2bit"``, ``"ternary"`` or ``None`` (not a low-bit load: 16-bit, NF4 or 8-bit as before)."""
    asked = _asked({"load_in_2bit": load_in_2bit, "load_in_ternary": load_in_ternary})
    if len(asked) > 1:
        check_flag_conflicts({"load_in_2bit": True, "load_in_ternary": True}, where)
    wanted = _FLAGS[asked[0]] if asked else None
    saved = saved_low_bit_record(config)
    if saved is not None:
        own = saved.get("format")
        if own not in LOW_BIT_FORMATS:
            raise ValueError(f"{where}: config.json says {CONFIG_KEY}.format={own!r}, which is none of "
                             f"{list(LOW_BIT_FORMATS)}; the checkpoint was not saved by this notebookkit.")
        if wanted is not None and wanted != own:
            raise ValueError(f"{where}: this checkpoint was saved pre-quantised in {BASE_FORMATS[own].label}; it "
                             f"cannot be loaded as {BASE_FORMATS[wanted].label}. Drop {asked[0]}=True (it loads as "
                             "saved), or load the 16-bit checkpoint it was made from.")
        return own
    if is_bitnet_config(config):
        if wanted == "2bit":
            raise ValueError(f"{where}: this is a BitNet b1.58 checkpoint (ternary weights); it loads as a ternary "
                             "base. Drop load_in_2bit=True (or pass load_in_ternary=True).")
        return "ternary"
    return wanted
