"""Vision-language model shapes: the text decoder's :class:`~.shapes.ModelShape` plus the vision tower.

A VLM, for memory purposes, is a vision tower (identical encoder blocks over image patches), a
projector that turns patch features into image tokens of the decoder's width, and the text decoder
of :mod:`notebookkit.memory.shapes`, whose sequence holds those image tokens. With

    Hv = vision hidden size     Dv = vision blocks       Iv = vision MLP width
    p  = patch size             m  = spatial merge (Qwen2.5-VL)      H = decoder hidden size

the two supported towers are

* **Qwen2.5-VL** (``qwen2_5_vl``): a Conv3d patch embedding (``Hv * 3 * t * p * p``, no bias, ``t``
  the temporal patch size); per block two RMSNorms (``2*Hv``), a fused ``qkv`` (``Hv -> 3*Hv``) and
  ``proj`` (``Hv -> Hv``), a gated MLP (gate, up ``Hv -> Iv``, down ``Iv -> Hv``), all with biases;
  the merger: an RMSNorm (``Hv``), then ``Hv*m^2 -> Hv*m^2 -> H`` linears with biases. An image of
  ``h x w`` pixels (resized to multiples of ``p*m``) is ``(h/p)*(w/p)`` patches and
  ``(h/p)*(w/p)/m^2`` image tokens.
* **Gemma 3** (``gemma3``, SigLIP): a Conv2d patch embedding with bias, a learned position table of
  ``(S/p)^2 * Hv`` (``S`` the tower's image size); per block two LayerNorms (``4*Hv``), q/k/v/out
  projections (``Hv -> Hv``) and ``fc1``/``fc2`` (``Hv -> Iv -> Hv``), all with biases; a final
  LayerNorm; the projector: an RMSNorm (``Hv``) and a bare ``Hv x H`` matrix. Every image is resized
  to ``S x S``: ``(S/p)^2`` patches, average-pooled to ``mm_tokens_per_image`` image tokens.

``KNOWN_VLMS`` lists the curated checkpoints from the public config numbers in
:data:`VLM_CONFIGS` (which the vision benchmark builds its random-weight models from).
``vlm_shape(x)`` turns a VLM config, dict, loaded model, curated name or local folder into a
:class:`VLMShape`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from notebookkit.families import for_vision_model_type, vision_families

from .shapes import PROJECTIONS, ModelShape, config_value, shape_from_config

#: Public config numbers (text decoder and vision tower) of the curated VLMs, by a short name. The
#: vision benchmark (``benchmarks/vision_step.py``) builds its random-weight checkpoints from these.
VLM_CONFIGS: dict[str, dict] = {
    "qwen2.5-vl-7b": dict(
        hub="Qwen/Qwen2.5-VL-7B-Instruct", family="qwen2", model_type="qwen2_5_vl",
        text=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                  num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}),
        vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
                    spatial_merge_size=2, temporal_patch_size=2, window_size=112, out_hidden_size=3584,
                    fullatt_block_indexes=[7, 15, 23, 31], in_channels=3, hidden_act="silu"),
        image_processor=dict(patch_size=14, merge_size=2, temporal_patch_size=2),
    ),
    "gemma-3-4b": dict(
        hub="google/gemma-3-4b-it", family="gemma3", model_type="gemma3",
        text=dict(vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                  sliding_window=1024, rms_norm_eps=1e-6, max_position_embeddings=131072,
                  hidden_activation="gelu_pytorch_tanh",
                  layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5 + ["sliding_attention"] * 4,
                  rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
        vision=dict(model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                    num_attention_heads=16, image_size=896, patch_size=14, vision_use_head=False),
        config=dict(mm_tokens_per_image=256),
        processor=dict(image_seq_length=256),
        image_size=896,
    ),
}


@dataclass(frozen=True)
class VisionTowerShape:
    """Config numbers of a VLM's vision tower and projector that decide its memory use.

    ``kind`` is ``"qwen2_5_vl"`` or ``"siglip"``; ``merge`` the spatial merge (Qwen2.5-VL, 1 for
    SigLIP); ``image_size`` SigLIP's fixed input side (``None`` for Qwen2.5-VL, which takes any
    size); ``tokens_per_image`` SigLIP's pooled token count (Gemma 3's ``mm_tokens_per_image``);
    ``window_size`` (pixels) and ``full_attention_blocks``: Qwen2.5-VL's attention windows, and how many
    blocks attend over whole images instead.
    """

    kind: str
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    text_hidden_size: int
    merge: int = 1
    temporal_patch_size: int = 1
    in_channels: int = 3
    image_size: int | None = None
    tokens_per_image: int | None = None
    window_size: int = 0
    full_attention_blocks: int = 0

    def block_linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``{name: (in_features, out_features)}`` of the linear layers of one block."""
        Hv, Iv = self.hidden_size, self.intermediate_size
        if self.kind == "qwen2_5_vl":
            return {"qkv": (Hv, 3 * Hv), "proj": (Hv, Hv), "gate_proj": (Hv, Iv), "up_proj": (Hv, Iv),
                    "down_proj": (Iv, Hv)}
        return {"q_proj": (Hv, Hv), "k_proj": (Hv, Hv), "v_proj": (Hv, Hv), "out_proj": (Hv, Hv),
                "fc1": (Hv, Iv), "fc2": (Iv, Hv)}

    def projector_linear_shapes(self) -> dict[str, tuple[int, int]]:
        """The projector's linear layers (Qwen2.5-VL's merger; Gemma 3's projector is a bare matrix: none)."""
        if self.kind == "qwen2_5_vl":
            wide = self.hidden_size * self.merge**2
            return {"merger.mlp.0": (wide, wide), "merger.mlp.2": (wide, self.text_hidden_size)}
        return {}

    @property
    def linear_params(self) -> int:
        """Weights of every linear layer (what ``load_in_4bit`` quantises): blocks and projector."""
        block = sum(i * o for i, o in self.block_linear_shapes().values())
        return self.num_layers * block + sum(i * o for i, o in self.projector_linear_shapes().values())

    @property
    def other_params(self) -> int:
        """Everything else (kept in the compute dtype): patch embedding, positions, norms, biases, the
        projector's matrix and norm."""
        Hv, p = self.hidden_size, self.patch_size
        block_bias = sum(o for _, o in self.block_linear_shapes().values())
        if self.kind == "qwen2_5_vl":
            wide = Hv * self.merge**2
            patch = Hv * self.in_channels * self.temporal_patch_size * p * p
            per_block = 2 * Hv + block_bias
            projector = Hv + wide + self.text_hidden_size  # ln_q, the two linears' biases
            return patch + self.num_layers * per_block + projector
        patches = (self.image_size // p) ** 2
        patch = Hv * self.in_channels * p * p + Hv + patches * Hv
        per_block = 4 * Hv + block_bias
        projector = Hv + Hv * self.text_hidden_size  # soft-embedding norm, input projection matrix
        return patch + self.num_layers * per_block + 2 * Hv + projector

    @property
    def num_params(self) -> int:
        return self.linear_params + self.other_params

    def image_grid(self, image_size: int | tuple[int, int] | None = None) -> tuple[int, int]:
        """``(patches, image tokens)`` of one image of ``image_size`` pixels (a side or ``(h, w)``).

        Qwen2.5-VL rounds each side to a multiple of ``p*m`` (at least one); SigLIP resizes to its own
        ``image_size`` whatever it is given.
        """
        if self.kind == "siglip":
            patches = (self.image_size // self.patch_size) ** 2
            return patches, int(self.tokens_per_image or patches)
        gh, gw = self._patch_sides(image_size)
        return gh * gw, gh * gw // self.merge**2

    def _patch_sides(self, image_size: int | tuple[int, int] | None) -> tuple[int, int]:
        """Qwen2.5-VL: patches along the height and the width of one image."""
        if image_size is None:
            raise ValueError("notebookkit.memory: a Qwen2.5-VL tower takes images of any size; pass image_size= "
                             "(pixels per side, or (height, width)), e.g. 448.")
        h, w = (image_size, image_size) if isinstance(image_size, int) else image_size
        factor = self.patch_size * self.merge
        return (max(factor, round(h / factor) * factor) // self.patch_size,
                max(factor, round(w / factor) * factor) // self.patch_size)

    def window_lengths(self, image_size: int | tuple[int, int] | None) -> list[int]:
        """Qwen2.5-VL: patches per attention window of one image, in the tower's order.

        The tower tiles the grid of merged patches with ``w x w`` windows, ``w = window_size / (patch * merge)``,
        row by row; the last row and column of windows are cut short where the grid is not a multiple of ``w``.
        """
        gh, gw = self._patch_sides(image_size)
        side = max(1, self.window_size // (self.patch_size * self.merge))

        def cuts(n: int) -> list[int]:
            return [side] * (n // side) + ([n % side] if n % side else [])

        return [rows * cols * self.merge**2 for rows in cuts(gh // self.merge) for cols in cuts(gw // self.merge)]


@dataclass(frozen=True)
class VLMShape:
    """A vision-language model: its text decoder's :class:`ModelShape`, its vision tower, and the
    image side its processor defaults to (``default_image_size``)."""

    name: str
    model_type: str
    text: ModelShape
    vision: VisionTowerShape
    default_image_size: int | None = None
    text_qkv_bias: bool = False  # Qwen2.5-VL's decoder has q/k/v biases, which ModelShape leaves out

    @property
    def text_bias_params(self) -> int:
        """The decoder's q/k/v biases, ``L * (dq + 2*dk)`` (Qwen2.5-VL; 0 for Gemma 3)."""
        t = self.text
        return t.num_layers * (t.q_dim + 2 * t.kv_dim) if self.text_qkv_bias else 0

    @property
    def text_params(self) -> int:
        """Parameters of the text decoder (embeddings, LM head unless tied, and biases included)."""
        return self.text.num_params + self.text_bias_params

    @property
    def num_params(self) -> int:
        return self.text_params + self.vision.num_params

    def image_grid(self, image_size: int | tuple[int, int] | None = None) -> tuple[int, int]:
        """``(patches, image tokens)`` per image (default size: :attr:`default_image_size`)."""
        return self.vision.image_grid(image_size if image_size is not None else self.default_image_size)

    def describe(self) -> str:
        v = self.vision
        return (f"{self.name} ({self.model_type}): {self.num_params / 1e9:.2f}B params; vision tower "
                f"{v.num_params / 1e6:.0f}M (Dv={v.num_layers}, Hv={v.hidden_size}, Iv={v.intermediate_size}, "
                f"patch {v.patch_size}); decoder {self.text.describe()}")


def is_vlm_config(cfg: Any) -> bool:
    """True for a config (object or dict) with a vision tower (``vision_config``)."""
    return config_value(cfg, "vision_config") is not None


def vlm_shape_from_config(cfg: Any, name: str | None = None, image_size: int | None = None) -> VLMShape:
    """Read a :class:`VLMShape` from a Qwen2.5-VL or Gemma 3 config (object or dict)."""
    model_type = str(config_value(cfg, "model_type", "") or "")
    vision = config_value(cfg, "vision_config")
    family = for_vision_model_type(model_type)
    if vision is None or family is None:
        known = " and ".join(f"{f.vision.label} ({t!r})" for t, f in vision_families().items())
        raise ValueError(
            f"notebookkit.memory: model_type {model_type!r} is not a supported vision-language model; the memory "
            f"model knows {known}, each with a vision_config."
        )
    text = shape_from_config(cfg, name=name)
    read_tower = _TOWERS.get(family.vision.tower)
    if read_tower is None:
        raise ValueError(f"notebookkit.memory: the family record names vision tower {family.vision.tower!r} for "
                         f"{model_type!r}, which the memory model has no formulas for ({', '.join(map(repr, _TOWERS))}).")
    tower, side = read_tower(cfg, vision, text.hidden_size)
    return VLMShape(name=text.name, model_type=model_type, text=text, vision=tower, default_image_size=image_size or side,
                    text_qkv_bias=family.vision.text_qkv_bias)


def _qwen2_5_vl_tower(cfg: Any, vision: Any, H: int) -> tuple[VisionTowerShape, int | None]:
    """Qwen2.5-VL's tower from its ``vision_config`` (it takes any image size: no default side)."""
    out = int(config_value(vision, "out_hidden_size", H) or H)
    if out != H:
        raise ValueError(f"notebookkit.memory: the vision merger's out_hidden_size ({out}) differs from the "
                         f"decoder's hidden_size ({H}); this config cannot run.")
    return VisionTowerShape(
        kind="qwen2_5_vl", hidden_size=int(config_value(vision, "hidden_size")), num_layers=int(config_value(vision, "depth")),
        intermediate_size=int(config_value(vision, "intermediate_size")), num_heads=int(config_value(vision, "num_heads")),
        patch_size=int(config_value(vision, "patch_size", 14)), text_hidden_size=H,
        merge=int(config_value(vision, "spatial_merge_size", 2)),
        temporal_patch_size=int(config_value(vision, "temporal_patch_size", 2)),
        in_channels=int(config_value(vision, "in_channels", 3)),
        window_size=int(config_value(vision, "window_size", 112)),
        full_attention_blocks=len(config_value(vision, "fullatt_block_indexes", []) or []),
    ), None


def _siglip_tower(cfg: Any, vision: Any, H: int) -> tuple[VisionTowerShape, int | None]:
    """A SigLIP tower (Gemma 3) from its ``vision_config``; every image is resized to its side."""
    side = int(config_value(vision, "image_size", 224))
    return VisionTowerShape(
        kind="siglip", hidden_size=int(config_value(vision, "hidden_size")), num_layers=int(config_value(vision, "num_hidden_layers")),
        intermediate_size=int(config_value(vision, "intermediate_size")),
        num_heads=int(config_value(vision, "num_attention_heads")), patch_size=int(config_value(vision, "patch_size", 14)),
        text_hidden_size=H, in_channels=int(config_value(vision, "num_channels", 3)), image_size=side,
        tokens_per_image=int(config_value(cfg, "mm_tokens_per_image", 256)),
    ), side


#: the tower formulas, by ``Vision.tower`` of the family record
_TOWERS = {"qwen2_5_vl": _qwen2_5_vl_tower, "siglip": _siglip_tower}


def _config_dict(short: str) -> dict:
    """The config dict of a curated VLM (the shape of what ``config.json`` holds)."""
    spec = VLM_CONFIGS[short]
    text = dict(spec["text"], model_type=spec["model_type"] + "_text")
    return dict(model_type=spec["model_type"], text_config=text, vision_config=dict(spec["vision"]),
                tie_word_embeddings=spec["text"].get("tie_word_embeddings", True), **spec.get("config", {}))


KNOWN_VLMS: dict[str, VLMShape] = {
    spec["hub"]: vlm_shape_from_config(_config_dict(short), name=spec["hub"], image_size=spec.get("image_size", 448))
    for short, spec in VLM_CONFIGS.items()
}


def _folder_image_size(path: Path) -> int | None:
    """The square side a saved processor resizes to, when it says (``size: {height}``, or Qwen2-VL's
    ``shortest_edge`` pixel count of a square), else ``None``."""
    for fname in ("processor_config.json", "preprocessor_config.json"):
        f = path / fname
        if f.is_file():
            cfg = json.loads(f.read_text())
            size = cfg.get("image_processor", cfg).get("size", {}) or {}
            if "height" in size:
                return int(size["height"])
            if "shortest_edge" in size and size.get("shortest_edge") == size.get("longest_edge"):
                return math.isqrt(int(size["shortest_edge"]))
    return None


def vlm_shape(model_config: Any, image_size: int | None = None) -> VLMShape:
    """Turn what a user has into a :class:`VLMShape`.

    Accepts a :class:`VLMShape`, a Hugging Face VLM config or model (its ``.config``), a config dict,
    a curated name from :data:`KNOWN_VLMS` (``"Qwen/Qwen2.5-VL-7B-Instruct"``, ``"google/gemma-3-4b-it"``),
    a short benchmark name from :data:`VLM_CONFIGS`, or a local folder (the tiny VLMs included: their
    processor's image size becomes :attr:`VLMShape.default_image_size`). ``image_size`` overrides the
    default image side.
    """
    if isinstance(model_config, VLMShape):
        shape = model_config
    elif isinstance(model_config, (str, os.PathLike)):
        name = str(model_config)
        known = _known_vlm(name)
        if known is not None:
            shape = known
        else:
            shape = _vlm_from_folder(name)
    else:
        cfg = getattr(model_config, "config", None)
        if cfg is not None and not isinstance(model_config, Mapping) and config_value(model_config, "vision_config") is None:
            model_config = cfg
        shape = vlm_shape_from_config(model_config)
    if image_size is not None:
        shape = dataclasses.replace(shape, default_image_size=image_size)
    return shape


def _known_vlm(name: str) -> VLMShape | None:
    if name in VLM_CONFIGS:
        return KNOWN_VLMS[VLM_CONFIGS[name]["hub"]]
    low = name.lower()
    return next((s for key, s in KNOWN_VLMS.items() if key.lower() == low), None)


def _vlm_from_folder(name: str) -> VLMShape:
    from notebookkit.embedded.tiny import is_tiny_vision_model_name, resolve_model_name

    path = Path(resolve_model_name(name) if is_tiny_vision_model_name(name) else name).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(
            f"notebookkit.memory: {name!r} is neither a curated vision-language model ({', '.join(KNOWN_VLMS)}) nor "
            "a local folder with a config.json. Pass the model's config (model.config) or its folder."
        )
    return vlm_shape_from_config(json.loads((path / "config.json").read_text()), name=name,
                                 image_size=_folder_image_size(path))


def is_vlm(model_config: Any) -> bool:
    """True when :func:`vlm_shape` applies: a :class:`VLMShape`, a VLM config/model/dict, a curated VLM
    name (not a text name: ``"google/gemma-3-4b-it"`` alone is its text decoder, see
    :data:`~.shapes.KNOWN_MODELS`), or a VLM folder."""
    if isinstance(model_config, VLMShape):
        return True
    if isinstance(model_config, ModelShape):
        return False
    if isinstance(model_config, (str, os.PathLike)):
        name = str(model_config)
        from .shapes import known_shape

        if name in VLM_CONFIGS or (_known_vlm(name) is not None and known_shape(name) is None):
            return True
        from notebookkit.embedded.tiny import is_tiny_vision_model_name

        if is_tiny_vision_model_name(name):
            return True
        path = Path(name).expanduser() / "config.json"
        return path.is_file() and "vision_config" in json.loads(path.read_text())
    if isinstance(model_config, Mapping):
        return is_vlm_config(model_config)
    cfg = getattr(model_config, "config", model_config)
    if not (is_vlm_config(cfg) and for_vision_model_type(str(config_value(cfg, "model_type", ""))) is not None):
        return False
    if hasattr(model_config, "named_modules"):  # a loaded model: only one that holds its vision tower
        base = model_config.get_base_model() if hasattr(model_config, "get_base_model") else model_config
        inner = getattr(base, "model", base)
        return any(hasattr(m, attr) for m in (base, inner) for attr in ("visual", "vision_tower"))
    return True


def text_shape(shape: Any) -> ModelShape:
    """The decoder's :class:`ModelShape` of a :class:`VLMShape`; a ``ModelShape`` as it is."""
    return shape.text if isinstance(shape, VLMShape) else shape


def _projection_of(parameter_name: str) -> str | None:
    """``"q_proj"`` for ``"...layers.0.self_attn.q_proj.lora_A.default.weight"`` (None: not a decoder projection)."""
    parts = parameter_name.split(".")
    for i, part in enumerate(parts):
        if part.startswith("lora_") and i > 0:
            return parts[i - 1] if parts[i - 1] in PROJECTIONS else None
    return None


def vision_kwargs_from_model(model: Any) -> dict[str, Any]:
    """What a loaded VLM (PEFT-wrapped or not) tells the estimate: ``finetune_vision_layers`` (whether a
    LoRA weight lies outside the language model and LM head), ``vision_lora_params`` (how many),
    ``target_modules`` (the decoder projections with adapters) and ``image_size`` (its processor's, read
    from the folder it was loaded from, when that folder says)."""
    out: dict[str, Any] = {}
    lora = [(n, p) for n, p in getattr(model, "named_parameters", lambda: [])() if "lora_" in n]
    if getattr(model, "peft_config", None):
        vision = [p for n, p in lora if "language_model" not in n and "lm_head" not in n]
        out["finetune_vision_layers"] = bool(vision)
        out["vision_lora_params"] = sum(p.numel() for p in vision)  # as adapted: the finetune_* switches decide
        # the decoder's adapted projections (the PEFT config's names cover both towers)
        out["target_modules"] = sorted({_projection_of(n) for n, _ in lora if "language_model" in n} - {None},
                                       key=PROJECTIONS.index)
    cfg = getattr(model, "config", None)
    folder = Path(str(getattr(cfg, "_name_or_path", "") or ""))
    if str(folder) and (folder / "config.json").is_file():
        size = _folder_image_size(folder)
        if size is not None:
            out["image_size"] = size
    return out
