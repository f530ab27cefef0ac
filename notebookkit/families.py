"""The model families notebookkit supports: one record per family, read by every layer.

Adding a family is one :class:`Family` row in :data:`FAMILIES` plus its tests; everything that
depends on a family reads the row:

* the patcher (:mod:`notebookkit.models.patching.patcher`, through :mod:`notebookkit.models.common.architectures`):
  which fused pieces a loaded model gets, looked up by the Hugging Face ``model_type``;
* the memory model (:mod:`notebookkit.memory.shapes`): q/k norms, sandwich norms and whether
  attention is soft-capped (an explicit softmax that keeps ``[B, heads, T, T]`` scores);
* the embedded default (:mod:`notebookkit.embedded`): the config class and settings of
  ``notebookkit/tiny-<name>`` and its tokenizer's special tokens;
* the chat templates (:mod:`notebookkit.data.chat_templates`): the format a family's name picks (or,
  ``chat_template=None``, the reason it picks none yet: ``chat_template_missing``);
  and the template its checkpoints ship (``tokenizer_template``, one copy in
  :mod:`notebookkit.tokenizer_templates`), which the tiny tokenizers carry;
* the GGUF export (:mod:`notebookkit.export.gguf_arch`): llama.cpp's architecture and the
  conversions its tensors and metadata need (:class:`GGUFLayout`);
* the memory model's vision shapes (:mod:`notebookkit.memory.vision_shapes`): which wrappers it
  knows and which tower formulas they take (:class:`Vision`);
* the widget catalogue (:mod:`notebookkit.widgets.catalog`) and the test helpers.

``tests/test_families.py`` fails when a row lacks any of these consumers.

The architecture facts of a row are what the patcher needs and cannot safely guess from module
names:

* ``activation``: gate activation of the gated MLP, ``down(act(gate(x)) * up(x))``:
  ``"swiglu"`` (SiLU), ``"geglu"`` (exact erf GELU) or ``"geglu_tanh"`` (tanh-approximated GELU).
  The config's own ``hidden_act`` / ``hidden_activation`` wins when it names one of these.
* ``norm``: how RMSNorm meets its weight (:data:`notebookkit.kernels.rms_norm.NORM_FLAVOURS`): ``"llama"``
  ``y = (x * rstd).to(dtype) * w``; ``"gemma"`` a unit offset in fp32, ``y = (x * rstd * (1 + w)).to(dtype)``;
  ``"gpt_oss"`` the weight multiply in fp32, ``y = (w * x * rstd).to(dtype)``. ``gemma_norm`` says whether it is
  Gemma's (the GGUF writer's norm shift, the tiny models' identity weights).
* ``qk_norm``: RMSNorm over the head dimension applied to queries and keys before RoPE
  (Qwen3, Gemma3).
* ``sandwich_norm``: extra norms after attention and after the MLP (Gemma2/3). The decoder layer
  of Hugging Face keeps that wiring; we only swap the norm's forward.
* ``scaled_embedding``: token embeddings multiplied by ``sqrt(hidden_size)`` (Gemma family). The
  model's own embedding module does it; the row documents it for the banner and the memory model.
* ``attn_softcap_attr`` / ``final_softcap_attr``: config attributes holding ``c`` of the soft-cap
  ``c * tanh(s / c)`` on attention scores and on the final logits (Gemma2, Gemma3 when set);
  ``default_attn_softcap`` is the value a config of the family has when it does not say.
* ``query_pre_attn_scalar``: attention scores are scaled by ``query_pre_attn_scalar ** -0.5``, a
  config number, instead of ``head_dim ** -0.5`` (Gemma2/3); the tiny and test models set it to
  their head dimension.
* ``sliding_window``: the config may set a sliding window on some layers; Hugging Face builds the
  per-layer masks and hands each attention the right one.
* ``attention_sinks``: each attention module holds ``sinks``, a learned logit a query head that joins the
  softmax's denominator and carries no value (gpt-oss): training runs it on
  :mod:`notebookkit.kernels.attention_sinks`, decoding in :mod:`notebookkit.models.generation.cache_attention`.
* ``fp16_overflow``: why the family's activations leave fp16's range (largest finite value 65504)
  with real checkpoints, or ``None``. Gemma 2 and 3 checkpoints carry residual-stream values of
  1e4-1e5; in fp16 they become inf. On a GPU without bf16 (a T4) ``dtype=None`` then picks fp32 and
  ``dtype=float16`` is refused with this reason (:func:`notebookkit.models.common.precision.family_dtype`;
  ``tests/models/test_gemma_fp16.py`` shows the overflow with weights scaled to those magnitudes).
* ``tied_embeddings``: the LM head shares the embedding table when a config does not say
  (``tie_word_embeddings``'s default in the family's config class; Gemma).
* ``gguf``: how llama.cpp lays the family out (:class:`GGUFLayout`), or ``None`` when GGUF export
  does not support it.
* ``moe``: the family's decoder MLP is a sparse mixture-of-experts block (:class:`MoE`: router, experts'
  layout, activation, routing rule), run on :mod:`notebookkit.kernels.moe_experts` by
  :mod:`notebookkit.models.patching.patch_moe`; ``None`` for a dense family.
* ``vision``: the vision-language model whose language decoder is this family (Qwen2.5-VL for
  ``qwen2``, Gemma 3 4B+ for ``gemma3``), read by ``FastVisionModel``
  (:mod:`notebookkit.models.fast_vision_model`), the vision collator
  (:mod:`notebookkit.data.vision_collator`) and the tiny VLM builder
  (:mod:`notebookkit.embedded.generate_vision_models`); see :class:`Vision`.

This module imports only the template texts of :mod:`notebookkit.tokenizer_templates` (no torch, no
transformers), so every layer can read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from notebookkit import tokenizer_templates


@dataclass(frozen=True)
class TinyRecipe:
    """How the embedded default builds ``notebookkit/tiny-<name>`` (:mod:`notebookkit.embedded`).

    The body every tiny model shares (hidden size, heads, MLP width, vocabulary, positions) is the
    builder's; a recipe adds the family's own part: the number of decoder layers, tied embeddings,
    the RoPE base (``local_rope_theta``: a second base for the sliding-window layers, Gemma 3) and
    optional scaling, and ``config``, further config arguments passed as they are. ``pretrained``
    models get a short pre-training on the bundled corpus; the others keep seeded random weights.
    """

    layers: int = 2
    tie_word_embeddings: bool = True
    rope_theta: float = 1000000.0
    rope_scaling: Optional[Mapping[str, Any]] = field(default=None, hash=False)
    local_rope_theta: Optional[float] = None
    pretrained: bool = False
    config: Mapping[str, Any] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class VisionRecipe:
    """How the embedded default builds ``notebookkit/tiny-<vision name>`` (a tiny random VLM).

    The language model is the family's tiny text model (shared body + :class:`TinyRecipe`); this
    adds the vision tower (``vision_config``: arguments of the wrapper's vision config), the image
    processor settings for the bundled 64x64 images (``image_processor``; ``video_processor`` for a
    wrapper whose processor also takes videos), the processor's own arguments (``processor``), further wrapper config arguments (``config``) and rotary arguments of
    the text config (``rope``, merged into its ``rope_parameters``). ``token_ids`` maps wrapper config
    keys to the special token whose id they hold; ``tokenizer_attributes`` names special tokens the
    processor reads off its tokenizer (``tokenizer.boi_token``). ``redraw`` lists parameters the
    library initialises to zero that a trained checkpoint never has at zero (Gemma 3's projection
    into the decoder: at zero no image would reach the language model); they are drawn from
    ``N(0, redraw_std^2)``. ``text_width_keys``: vision config keys that hold the decoder's hidden size
    (the builder's, so they are set by it). ``pretrained``: the decoder gets the short pre-training of
    ``tiny-llama`` on the bundled corpus plus sentences in the caption grammar (text only; the vision
    tower keeps its random weights), so a CPU fine-tune in a notebook has to learn to read images,
    not a language.
    """

    vision_config: Mapping[str, Any] = field(default_factory=dict, hash=False)
    image_processor: Mapping[str, Any] = field(default_factory=dict, hash=False)
    video_processor: Mapping[str, Any] = field(default_factory=dict, hash=False)
    processor: Mapping[str, Any] = field(default_factory=dict, hash=False)
    config: Mapping[str, Any] = field(default_factory=dict, hash=False)
    rope: Mapping[str, Any] = field(default_factory=dict, hash=False)
    token_ids: Mapping[str, str] = field(default_factory=dict, hash=False)
    tokenizer_attributes: Mapping[str, str] = field(default_factory=dict, hash=False)
    redraw: tuple[str, ...] = ()
    redraw_std: float = 0.05
    text_width_keys: tuple[str, ...] = ()
    pretrained: bool = False


@dataclass(frozen=True)
class GGUFLayout:
    """How llama.cpp lays out a family in GGUF (:mod:`notebookkit.export.gguf_arch` has the formulas).

    * ``arch``: llama.cpp's architecture name (a ``gguf.MODEL_ARCH_NAMES`` value);
    * ``permute_qk``: llama.cpp's ``llama`` architecture rotates adjacent pairs, Hugging Face rotates
      halves: the rows of ``q_proj`` / ``k_proj`` are reordered per head;
    * ``attn_softcap``: llama.cpp reads the attention logit soft-cap of this architecture (Gemma 2;
      the final-logit soft-cap is written for every family whose config has one);
    * ``sliding_pattern``: llama.cpp reads the per-layer sliding-window pattern (Gemma 2/3).

    Gemma's ``(1 + w)`` norms are stored as ``1 + w``: that follows ``Family.gemma_norm``.
    """

    arch: str
    permute_qk: bool = False
    attn_softcap: bool = False
    sliding_pattern: bool = False


@dataclass(frozen=True)
class MoE:
    """A sparse mixture-of-experts MLP as a family's Hugging Face classes lay it out.

    A block holds a router (``router``: attribute of the block, ``[E, H]`` weight, a bias when
    ``router_bias``) and an experts module (``experts``) with two stacked weights, ``gate_up_proj``
    and ``down_proj`` (biases ``gate_up_proj_bias`` / ``down_proj_bias`` when ``expert_bias``).
    ``transposed``: the stacked weights are ``[E, in, out]`` (gpt-oss), not ``[E, out, in]`` (Qwen3-MoE).
    ``activation``: the experts' gated activation, a :data:`notebookkit.kernels.moe_experts.ACTIVATIONS`
    name (``"swiglu"``: ``[gate; up]`` halves; ``"gpt_oss"``: interleaved, clamped at ``swiglu_limit``).
    ``routing``, over router logits ``z = x R^T (+ b)`` of one token, in fp32:

    * ``"softmax_topk"`` (Qwen3-MoE): ``p = softmax(z)``, keep the ``k`` largest ``p``; with the config's
      ``norm_topk_prob`` the kept ones are divided by their sum;
    * ``"topk_softmax"`` (gpt-oss): keep the ``k`` largest ``z``, weights ``softmax`` over those ``k``.

    ``num_experts`` / ``intermediate``: the config attributes holding ``E`` and the experts' ``I``.
    ``returns_scores``: the block returns ``(y, router scores)`` (gpt-oss), not ``y``. The router's
    load-balancing loss is Hugging Face's (the model adds ``router_aux_loss_coef`` times it when
    ``output_router_logits`` is set); the patched router still returns the logits it records.
    ``lora_parameters``: what ``LoraConfig(target_parameters=...)`` names to adapt the experts.
    ``saved_per_expert``: the family's checkpoints store each expert as its own linear layers,
    ``experts.{e}.<gate>.weight [I, H]``, ``<up>`` and ``<down> [H, I]`` (these three names; Qwen3-MoE), which
    transformers stacks on loading; empty when they store the stacked parameters as the model holds them
    (gpt-oss). The merged export writes the family's own checkpoint layout.
    ``peft_maps_mlp_targets``: PEFT itself (0.21 with transformers 5) turns ``target_modules`` naming
    ``gate_proj`` / ``up_proj`` / ``down_proj`` into adapters on the stacked experts (``gate_up_proj`` at rank
    ``2 r`` and alpha ``2 alpha``, as the two v4 adapters it fuses), so ``get_peft_model`` leaves the
    targets to PEFT; otherwise (gpt-oss) it adds ``lora_parameters`` when the MLP is targeted.
    """

    router: str
    routing: str
    activation: str
    num_experts: str
    intermediate: str
    transposed: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    returns_scores: bool = False
    experts: str = "experts"
    peft_maps_mlp_targets: bool = False
    lora_parameters: tuple[str, ...] = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    saved_per_expert: tuple[str, ...] = ()


@dataclass(frozen=True)
class Vision:
    """A vision-language wrapper (``*ForConditionalGeneration``) whose language model is a family's.

    Facts ``FastVisionModel`` needs and cannot guess from module names:

    * ``model_type`` / ``config_class`` / ``model_class``: the wrapper as transformers names it;
      ``text_model_type``: the ``model_type`` of its text config;
    * ``vision_tower`` / ``projector`` / ``language_model``: attribute paths, from the wrapper, of the
      image encoder, of the module mapping its features into the decoder's embedding space, and of the
      text backbone (whose decoder layers run the fused path);
    * ``rope``: ``"mrope"`` when the decoder's rotary embedding is multimodal (Qwen2.5-VL: positions
      along time, height and width, each rotating its own section of the frequencies; the rotary
      module composes them into one ``[B, T, head_dim]`` table, which the RoPE kernel applies as it
      applies any per-token table), ``"rotate_half"`` otherwise;
    * ``image_tokens``: the special tokens a tokenizer of this wrapper has (the tiny builder adds
      them to the shared vocabulary); ``image_token``: the one repeated once per image feature;
    * ``tower_attention``: ``"segments"`` when the tower attends within segments of one patch
      sequence given by ``cu_seqlens`` (Qwen2.5-VL's windows and images), which
      :mod:`notebookkit.models.vision.tower_attention` runs as one SDPA call per segment length;
      ``"stock"`` otherwise (SigLIP's per-image attention is one batched call already);
    * ``tower``: the memory model's formulas for the tower and projector
      (:class:`notebookkit.memory.vision_shapes.VisionTowerShape`: ``"qwen2_5_vl"`` or ``"siglip"``);
      ``text_qkv_bias``: the decoder's q/k/v projections have biases; ``label``: the wrapper in messages.
    """

    name: str  # notebookkit/tiny-<name>, test ids
    model_type: str
    config_class: str
    model_class: str
    text_model_type: str
    processor_class: str
    image_processor_class: str
    vision_tower: str
    projector: str
    language_model: str
    image_tokens: tuple[str, ...]
    image_token: str
    tiny: VisionRecipe
    tower: str
    label: str
    tokenizer_template: str  # the wrapper's chat template, with image parts (notebookkit.tokenizer_templates)
    text_qkv_bias: bool = False
    rope: str = "rotate_half"
    tower_attention: str = "stock"
    hub_example: str = ""  # a hub checkpoint of the wrapper, for messages

    @property
    def tiny_name(self) -> str:
        """The reserved name of the tiny VLM of this wrapper."""
        return f"notebookkit/tiny-{self.name}"


@dataclass(frozen=True)
class Family:
    """Everything notebookkit knows about one model family (see the module docstring)."""

    name: str  # canonical name: notebookkit/tiny-<name>, test ids, the catalogue
    model_types: tuple[str, ...]  # Hugging Face model_type(s) of the causal LM, the ones patched
    config_class: str  # the transformers config class of that model_type
    # the notebookkit.data.chat_templates format of the family, or None where notebookkit has none yet (then
    # get_chat_template refuses the family's name with chat_template_missing as the reason)
    chat_template: Optional[str]
    tokens: str  # the tiny tokenizer's special-token set (notebookkit.embedded.generate_tokenizer)
    tokenizer_template: str  # the chat template the family's checkpoints ship (notebookkit.tokenizer_templates)
    tiny: TinyRecipe
    activation: str = "swiglu"
    norm: str = "llama"
    qk_norm: bool = False
    sandwich_norm: bool = False
    scaled_embedding: bool = False
    attn_softcap_attr: Optional[str] = None
    final_softcap_attr: Optional[str] = None
    default_attn_softcap: Optional[float] = None
    query_pre_attn_scalar: bool = False
    sliding_window: bool = False
    attention_sinks: bool = False
    rope_style: str = "rotate_half"
    fp16_overflow: Optional[str] = None
    tied_embeddings: bool = False
    gguf: Optional[GGUFLayout] = None
    moe: Optional[MoE] = None
    chat_template_missing: str = ""
    # multimodal wrappers whose text model is this family: the memory model reads their shapes,
    # the patcher leaves them on stock code (never half-patched)
    multimodal_model_types: tuple[str, ...] = ()
    # the vision-language wrapper FastVisionModel fine-tunes with this family's decoder (one of the
    # multimodal_model_types), or None
    vision: Optional[Vision] = None

    @property
    def gemma_norm(self) -> bool:
        """RMSNorm with the unit offset ``1 + w`` (Gemma): stored weights are ``w``, the identity is 0."""
        return self.norm == "gemma"

    @property
    def tiny_name(self) -> str:
        """The reserved name of the family's tiny default model."""
        return f"notebookkit/tiny-{self.name}"


_GEMMA_TANH = {"hidden_activation": "gelu_pytorch_tanh"}
_GEMMA_FP16 = ("Gemma 2 and Gemma 3 checkpoints carry residual-stream activations of 1e4-1e5, beyond float16's "
               "largest value (65504): in float16 they become inf and the loss NaN")

# Tiny vision towers see the bundled 64x64 images as 8x8 patches of 8x8 pixels (64 patches) and
# hand 16 image features to the decoder: Qwen2.5-VL merges 2x2 patches, Gemma 3 average-pools 2x2.
_QWEN25_VL = Vision(
    "qwen2.5-vl", "qwen2_5_vl", "Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl_text",
    processor_class="Qwen2_5_VLProcessor", image_processor_class="Qwen2VLImageProcessorPil",
    vision_tower="model.visual", projector="model.visual.merger", language_model="model.language_model",
    image_tokens=("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
    image_token="<|image_pad|>", rope="mrope", tower_attention="segments", hub_example="Qwen/Qwen2.5-VL-7B-Instruct",
    tower="qwen2_5_vl", label="Qwen2.5-VL", text_qkv_bias=True,
    tokenizer_template=tokenizer_templates.QWEN2_5_VL,
    tiny=VisionRecipe(
        vision_config={"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "patch_size": 8,
                       "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 32,
                       "fullatt_block_indexes": [1], "in_channels": 3},
        image_processor={"patch_size": 8, "merge_size": 2, "temporal_patch_size": 2,
                         "min_pixels": 64 * 64, "max_pixels": 64 * 64},
        video_processor={"video_processor_type": "Qwen2VLVideoProcessor", "patch_size": 8, "merge_size": 2,
                         "temporal_patch_size": 2, "size": {"shortest_edge": 64 * 64, "longest_edge": 64 * 64}},
        # time / height / width sections of the 16 rotary frequencies of a 32-wide head
        rope={"mrope_section": [4, 6, 6]},
        token_ids={"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                   "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"},
        tokenizer_attributes={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
        text_width_keys=("out_hidden_size",),
    ),
)
_GEMMA3_VISION = Vision(
    "gemma3-vision", "gemma3", "Gemma3Config", "Gemma3ForConditionalGeneration", "gemma3_text",
    processor_class="Gemma3Processor", image_processor_class="Gemma3ImageProcessorPil",
    vision_tower="model.vision_tower", projector="model.multi_modal_projector",
    language_model="model.language_model",
    image_tokens=("<start_of_image>", "<end_of_image>", "<image_soft_token>"), image_token="<image_soft_token>",
    hub_example="google/gemma-3-4b-it", tower="siglip", label="Gemma 3",
    tokenizer_template=tokenizer_templates.GEMMA3_VISION,
    tiny=VisionRecipe(
        vision_config={"model_type": "siglip_vision_model", "hidden_size": 64, "intermediate_size": 128,
                       "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 64, "patch_size": 8,
                       "vision_use_head": False},
        image_processor={"size": {"height": 64, "width": 64}, "do_pan_and_scan": False},
        processor={"image_seq_length": 16},
        config={"mm_tokens_per_image": 16},
        token_ids={"boi_token_index": "<start_of_image>", "eoi_token_index": "<end_of_image>",
                   "image_token_index": "<image_soft_token>"},
        tokenizer_attributes={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"},
        redraw=("model.multi_modal_projector.mm_input_projection_weight",),
        pretrained=True,  # the vision notebook's CPU default
    ),
)
_ALTERNATING = {"sliding_window": 512, "layer_types": ["sliding_attention", "full_attention"]}

_QWEN3_MOE = MoE(router="gate", routing="softmax_topk", activation="swiglu", num_experts="num_experts",
                 intermediate="moe_intermediate_size", peft_maps_mlp_targets=True,
                 saved_per_expert=("gate_proj", "up_proj", "down_proj"))
_GPT_OSS = MoE(router="router", routing="topk_softmax", activation="gpt_oss", num_experts="num_local_experts",
               intermediate="intermediate_size", transposed=True, router_bias=True, expert_bias=True,
               returns_scores=True)
# Tiny MoE bodies: 8 experts (Qwen3-MoE) / 4 experts (gpt-oss), 2 a token, experts 96 wide
_TINY_MOE = {"num_experts_per_tok": 2, "router_aux_loss_coef": 0.01}

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family(
        "llama", ("llama",), "LlamaConfig", chat_template="llama-3", tokens="llama",
        tokenizer_template=tokenizer_templates.LLAMA3,
        gguf=GGUFLayout("llama", permute_qk=True),
        tiny=TinyRecipe(
            layers=4, pretrained=True, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 256},
            config={"rms_norm_eps": 1e-5},
        ),
    ),
    Family(
        "mistral", ("mistral",), "MistralConfig", chat_template="mistral", tokens="mistral",
        tokenizer_template=tokenizer_templates.MISTRAL, sliding_window=True,
        gguf=GGUFLayout("llama", permute_qk=True),
        tiny=TinyRecipe(tie_word_embeddings=False, config={"rms_norm_eps": 1e-5, "sliding_window": 1024}),
    ),
    Family(
        "qwen2", ("qwen2",), "Qwen2Config", chat_template="qwen-2.5", tokens="qwen2",
        tokenizer_template=tokenizer_templates.QWEN2, sliding_window=True,
        gguf=GGUFLayout("qwen2"),
        multimodal_model_types=("qwen2_5_vl",), vision=_QWEN25_VL,
        tiny=TinyRecipe(config={"rms_norm_eps": 1e-6, "use_sliding_window": False}),
    ),
    Family(
        "qwen3", ("qwen3",), "Qwen3Config", chat_template="qwen-3", tokens="qwen3",
        tokenizer_template=tokenizer_templates.QWEN3, qk_norm=True,
        sliding_window=True, gguf=GGUFLayout("qwen3"),
        tiny=TinyRecipe(config={"rms_norm_eps": 1e-6, "use_sliding_window": False, "attention_bias": False}),
    ),
    Family(
        "qwen3_moe", ("qwen3_moe",), "Qwen3MoeConfig", chat_template="qwen-3", tokens="qwen3",
        tokenizer_template=tokenizer_templates.QWEN3, qk_norm=True, sliding_window=True, moe=_QWEN3_MOE,
        gguf=GGUFLayout("qwen3moe"),
        tiny=TinyRecipe(tie_word_embeddings=False, config={
            "rms_norm_eps": 1e-6, "use_sliding_window": False, "attention_bias": False, **_TINY_MOE,
            "num_experts": 8, "moe_intermediate_size": 96, "norm_topk_prob": True,
        }),
    ),
    Family(
        # the tiny tokenizer speaks ChatML (the shared tiny vocabulary has no harmony tokens); real gpt-oss
        # tokenizers ship their harmony template, which notebookkit has no format of yet
        "gpt_oss", ("gpt_oss",), "GptOssConfig", chat_template=None, tokens="qwen3",
        chat_template_missing="gpt-oss speaks OpenAI's harmony format (<|start|>role<|channel|>...<|message|>...<|end|>), "
                              "which notebookkit's get_chat_template does not write yet (#36): keep the template "
                              "its tokenizer ships (do not call get_chat_template)",
        tokenizer_template=tokenizer_templates.QWEN2, sliding_window=True, attention_sinks=True, moe=_GPT_OSS,
        norm="gpt_oss",
        gguf=GGUFLayout("gpt-oss"),
        tiny=TinyRecipe(tie_word_embeddings=False, rope_theta=150000.0, config={
            "rms_norm_eps": 1e-5, **_TINY_MOE, "num_local_experts": 4, "intermediate_size": 96,
            "swiglu_limit": 7.0, "attention_bias": True, **_ALTERNATING,
        }),
    ),
    Family(
        "gemma", ("gemma",), "GemmaConfig", chat_template="gemma", tokens="gemma",
        tokenizer_template=tokenizer_templates.GEMMA, activation="geglu_tanh",
        norm="gemma", scaled_embedding=True, tied_embeddings=True, gguf=GGUFLayout("gemma"),
        tiny=TinyRecipe(rope_theta=10000.0,
                        config={"rms_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh", **_GEMMA_TANH}),
    ),
    Family(
        "gemma2", ("gemma2",), "Gemma2Config", chat_template="gemma", tokens="gemma",
        tokenizer_template=tokenizer_templates.GEMMA, activation="geglu_tanh",
        norm="gemma", sandwich_norm=True, scaled_embedding=True,
        attn_softcap_attr="attn_logit_softcapping", final_softcap_attr="final_logit_softcapping",
        default_attn_softcap=50.0, query_pre_attn_scalar=True, sliding_window=True, tied_embeddings=True,
        fp16_overflow=_GEMMA_FP16,
        gguf=GGUFLayout("gemma2", attn_softcap=True, sliding_pattern=True),
        tiny=TinyRecipe(rope_theta=10000.0, config={
            "rms_norm_eps": 1e-6, **_GEMMA_TANH, **_ALTERNATING,
            "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
        }),
    ),
    Family(
        "gemma3", ("gemma3_text",), "Gemma3TextConfig", chat_template="gemma-3", tokens="gemma",
        tokenizer_template=tokenizer_templates.GEMMA,
        activation="geglu_tanh", norm="gemma", qk_norm=True, sandwich_norm=True, scaled_embedding=True,
        attn_softcap_attr="attn_logit_softcapping", final_softcap_attr="final_logit_softcapping",
        query_pre_attn_scalar=True, sliding_window=True, multimodal_model_types=("gemma3",),
        vision=_GEMMA3_VISION, tied_embeddings=True, gguf=GGUFLayout("gemma3", sliding_pattern=True),
        fp16_overflow=_GEMMA_FP16,
        tiny=TinyRecipe(local_rope_theta=10000.0, config={
            "rms_norm_eps": 1e-6, **_GEMMA_TANH, **_ALTERNATING,
            "attn_logit_softcapping": None, "final_logit_softcapping": None,
        }),
    ),
)}

_BY_MODEL_TYPE: dict[str, Family] = {t: f for f in FAMILIES.values() for t in f.model_types}
_BY_WRAPPER_TYPE: dict[str, Family] = {t: f for f in FAMILIES.values() for t in f.multimodal_model_types}
# a wrapper's text config names its own model_type (qwen2_5_vl_text): the memory model reads it too
_BY_WRAPPER_TYPE.update({f.vision.text_model_type: f for f in FAMILIES.values()
                         if f.vision is not None and f.vision.text_model_type not in _BY_MODEL_TYPE})
_BY_VISION_TYPE: dict[str, Family] = {f.vision.model_type: f for f in FAMILIES.values() if f.vision is not None}


def family(name: str) -> Family:
    """The record of family ``name`` (``"llama"``, ``"gemma3"``, ...); a readable error otherwise."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"Unknown model family {name!r}; the supported families are: {', '.join(FAMILIES)}.") from None


def for_model_type(model_type: Any, multimodal: bool = False) -> Optional[Family]:
    """The family whose causal LM has Hugging Face ``model_type``, or ``None``.

    With ``multimodal=True`` a multimodal wrapper's ``model_type`` (``"gemma3"``) names the family
    of its text model too (the memory model wants its shape; the patcher does not patch it).
    """
    found = _BY_MODEL_TYPE.get(model_type)
    if found is None and multimodal:
        found = _BY_WRAPPER_TYPE.get(model_type)
    return found


def vision_families() -> dict[str, Family]:
    """The families with a vision-language wrapper, by the wrapper's ``model_type``."""
    return dict(_BY_VISION_TYPE)


def for_vision_model_type(model_type: Any) -> Optional[Family]:
    """The family whose vision-language wrapper has Hugging Face ``model_type`` (``"qwen2_5_vl"``), or ``None``."""
    return _BY_VISION_TYPE.get(model_type)


def vision_support_error(model_type: Any, what: str = "This model") -> ValueError:
    """The readable error for a model without vision support: which wrappers are supported, and how to load them."""
    listing = "\n".join(
        f"  - {t} ({f.vision.model_class}; e.g. {f.vision.hub_example!r}, tiny {f.vision.tiny_name!r}; "
        f"language model: the {f.name} family)" for t, f in sorted(_BY_VISION_TYPE.items())
    )
    text_hint = ""
    if model_type in _BY_MODEL_TYPE:
        text_hint = (f"\n{model_type!r} is a text-only model of the {_BY_MODEL_TYPE[model_type].name} family: "
                     "fine-tune it with FastLanguageModel and text data instead.")
    return ValueError(
        f"{what} has model_type {model_type!r}, which has no vision support in notebookkit. "
        f"The supported vision-language models are:\n{listing}{text_hint}"
    )


def supported_model_types() -> list[str]:
    """The ``model_type`` values that run on the fused path."""
    return sorted(_BY_MODEL_TYPE)
