"""``model.generate(...)`` on the static KV cache: prefill once, then one captured step per token.

``FastLanguageModel.for_inference(model)`` binds :func:`generate` on the causal LM instance
(:func:`bind_generate`; ``for_training`` removes it again), so the ordinary call sites (notebook
chat cells, evaluation, TRL's GRPO, a PEFT model's ``generate``) reach it unchanged. It takes
Hugging Face's arguments and returns what Hugging Face returns for them: the prompt ids followed by
the new ones, ``[B, P + N]``, a row that stopped padded with ``pad_token_id``.

The loop, for a batch left-padded to ``P`` columns (``pad[b]`` leading padding slots in row ``b``)::

    logits = cached_forward(prompt, slots 0 .. P-1)              eager prefill on the fused kernels
    next   = choose(filter(logits))                              sampling.py (HF's processors, greedy or sampled)
    repeat until N tokens or every row stopped:
        one decode step (a CUDA graph per batch size and cache-length bucket, :mod:`.graph_runner`):
            logits = cached_forward(next, slot t)                reads cache slots 0 .. bucket-1
            next   = choose(filter(logits)), pad_token_id in rows already stopped
            ids[:, t + 1] = next;  stopped |= next in eos_ids;  t += 1

``bucket`` is the smallest power of two (at least 16) that covers slot ``t``, capped at the cache
capacity, so a step reads about as much cache as it needs, with a few graphs per batch size. A call
that starts without a cache because :func:`~.state.drop_cache` freed the last one (GRPO when memory is
short frees it after every generation, :class:`~notebookkit.train.FastGRPOTrainer`) would capture every
bucket's graph again each time, about 90 ms each on an H200 (session 13: 0.36 s of a 1B GRPO step); it
captures one instead, for the whole request (``prompt + max_new_tokens`` slots rounded up to 16), whose
step reads the slots of the later buckets from the start (hidden by the mask, as unwritten slots always
are: the same tokens). A call that finds its cache kept uses the buckets again. The
host reads the device only every few steps (every step with a streamer, or on the CPU), to stop
when all rows are done; the ids of extra steps are never returned.

A model whose prompt is more than token ids (a vision-language model's images) carries its own prompt
preparation (:func:`set_prompt_preparation`, set by its loader): it says whether the fast path can
run the call and hands back the prefill that fills the cache; the loop itself knows nothing of images.

Anything this path does not implement runs Hugging Face's own ``generate`` instead, with a
one-time warning and a banner note that say why: beam search and other decoding modes, output
dicts, scores, logits processors or stopping criteria passed in, assistant models, constraints and
the other logits processors of the generation config, models outside the family table, a model in
training mode. Bad input raises a ``ValueError`` that says what to change: right padding,
``max_new_tokens`` beyond ``max_seq_length``, an attention mask with gaps.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
import torch.nn as nn

from notebookkit.base_layers.rebinding import WeakBoundMethod
from notebookkit.compat import prepare_generation_config
from notebookkit.marks import PREPARE_PROMPT

from ..common.banner import get_banner
from ..patching import forward_state
from .cached_forward import cached_forward
from .decoder_plan import DecoderPlan, causal_lm_of
from .graph_runner import graphs_enabled
from .sampling import SamplingSettings, choose_next, filter_logits, mark_seen, new_seen_mask
from .state import GenerationState, generation_state
from .static_cache import StaticKVCache

__all__ = ["generate", "bind_generate", "unbind_generate", "is_bound", "describe_generation", "cache_capacity",
           "bucket_for", "left_pad_lengths", "set_prompt_preparation", "SamplingSettings"]

MIN_BUCKET = 16
CACHE_ROUNDING = 256  # cache slots are allocated in multiples of this
CHECK_EVERY_GPU = 8  # decode steps between host reads of "every row stopped" on a GPU
_FAST_MODES = ("greedy_search", "sample")

#: (model, input_ids, cache, start_slot, pad_lengths) -> (last logits [B, V], RoPE offsets [B] or None)
Prefill = Callable[[nn.Module, torch.Tensor, Any, int, torch.Tensor], tuple[torch.Tensor, Optional[torch.Tensor]]]
#: (model, generate's keywords) -> the reason the fast path cannot run them, or (prefill or None, keywords left)
PreparePrompt = Callable[[nn.Module, dict], Union[str, tuple[Optional[Prefill], dict]]]

# Settings that change the tokens and are not implemented here, with the values that leave them off.
_OFF_VALUES: dict[str, tuple] = {
    "max_time": (None,), "stop_strings": (None,),
    "typical_p": (None, 1.0), "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0), "top_h": (None,),
    "encoder_repetition_penalty": (None, 1.0), "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0), "bad_words_ids": (None,), "force_words_ids": (None,),
    "constraints": (None,), "sequence_bias": (None,), "suppress_tokens": (None,), "begin_suppress_tokens": (None,),
    "forced_bos_token_id": (None,), "forced_eos_token_id": (None,), "exponential_decay_length_penalty": (None,),
    "guidance_scale": (None, 1.0), "watermarking_config": (None,), "token_healing": (None, False),
    "remove_invalid_values": (None, False), "prompt_lookup_num_tokens": (None,), "dola_layers": (None,),
    "penalty_alpha": (None,), "output_scores": (None, False), "output_logits": (None, False),
    "output_attentions": (None, False), "output_hidden_states": (None, False),
    "return_dict_in_generate": (None, False),
}


# --------------------------------------------------------------------------------------------------
# Binding on the model instance
# --------------------------------------------------------------------------------------------------


def bind_generate(model: nn.Module) -> bool:
    """Make ``model.generate`` (and its causal LM's) the fast path; returns whether the model can run it."""
    causal_lm = causal_lm_of(model)
    plan = generation_state(causal_lm).refresh(causal_lm)
    if not isinstance(plan, DecoderPlan):
        unbind_generate(model)
        return False
    object.__setattr__(causal_lm, "generate", WeakBoundMethod(generate, causal_lm))
    return True


def unbind_generate(model: nn.Module) -> None:
    """Give ``model`` Hugging Face's ``generate`` back (the state, cache included, is kept)."""
    causal_lm = causal_lm_of(model)
    if is_bound(causal_lm):
        del causal_lm.__dict__["generate"]


def is_bound(model: nn.Module) -> bool:
    """Whether ``model.generate`` is notebookkit's fast path."""
    bound = causal_lm_of(model).__dict__.get("generate")
    return isinstance(bound, WeakBoundMethod) and bound.__func__ is generate


def set_prompt_preparation(model: nn.Module, prepare: PreparePrompt) -> None:
    """Let ``prepare`` split every fast ``generate`` call of ``model`` before the decode loop runs.

    ``prepare(model, keywords)`` returns the reason the fast path cannot run the call, or ``(prefill,
    keywords left)`` where ``prefill`` (``None``: :func:`.cached_forward` over the prompt) fills the cache
    and gives the last logits and per-row RoPE offsets. A model's loader sets it (a vision-language
    wrapper: its image prompts run the model's own forward first, :mod:`notebookkit.models.vision.decode`);
    without one, the keywords go to the decode path as they are.
    """
    object.__setattr__(causal_lm_of(model), PREPARE_PROMPT, prepare)


def _prepare_prompt(model: nn.Module, kwargs: dict) -> Union[str, tuple[Optional[Prefill], dict]]:
    prepare = model.__dict__.get(PREPARE_PROMPT)
    return (None, kwargs) if prepare is None else prepare(model, kwargs)


def describe_generation(model: nn.Module, banner: Any, bound: bool) -> None:
    """The banner's ``fast generation`` line for a model after ``for_inference``."""
    state = generation_state(model)
    if not bound:
        banner.feature("fast generation", False, f"model.generate is Hugging Face's: {state.plan}")
        return
    plan = state.plan
    device = plan.device()
    how = ("the decode step replayed as a CUDA graph per batch size and cache-length bucket"
           if graphs_enabled(device) else f"the decode step run eagerly on {device.type.upper()} (graphs need CUDA)")
    banner.feature(
        "fast generation", True,
        f"model.generate: static KV cache ({len(plan.layers)} layers, prompt + max_new_tokens slots rounded up "
        f"to {CACHE_ROUNDING}, at most max_seq_length), prefill on the fused kernels, {how}; LoRA adapters unmerged",
    )


# --------------------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------------------


def generate(
    self: nn.Module,
    inputs: Optional[torch.Tensor] = None,
    generation_config: Any = None,
    logits_processor: Any = None,
    stopping_criteria: Any = None,
    prefix_allowed_tokens_fn: Optional[Callable] = None,
    synced_gpus: Optional[bool] = None,
    assistant_model: Optional[nn.Module] = None,
    streamer: Any = None,
    negative_prompt_ids: Optional[torch.Tensor] = None,
    negative_prompt_attention_mask: Optional[torch.Tensor] = None,
    **kwargs: Any,
) -> Any:
    """Generate continuations of ``input_ids`` (Hugging Face's ``generate`` arguments and result).

    Usual keywords: ``input_ids``, ``attention_mask`` (left padding for batches:
    ``tokenizer.padding_side = "left"``), ``max_new_tokens``, ``do_sample``, ``temperature``,
    ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``, ``eos_token_id`` (an int or a list: every
    one stops a row), ``pad_token_id``, ``generation_config``, ``streamer`` (``TextStreamer``),
    ``num_return_sequences`` (with sampling).

    Returns ``[B, P + N]`` token ids: the prompt, then up to ``max_new_tokens`` new tokens per row,
    rows that stopped early padded with ``pad_token_id``. Settings this path does not implement run
    Hugging Face's ``generate`` (a warning says which, once).

    Raises:
        ValueError: right padding (set ``tokenizer.padding_side = "left"``), an attention mask with
            gaps or an empty row, or a prompt plus ``max_new_tokens`` longer than the model's
            ``max_seq_length`` (the size limit of the static KV cache).
    """
    hf_only = {"logits_processor": logits_processor, "stopping_criteria": stopping_criteria,
               "prefix_allowed_tokens_fn": prefix_allowed_tokens_fn, "synced_gpus": synced_gpus,
               "assistant_model": assistant_model, "negative_prompt_ids": negative_prompt_ids,
               "negative_prompt_attention_mask": negative_prompt_attention_mask}
    state = generation_state(self)
    with torch.no_grad():
        state.casts.refresh(every=True)  # an 8-bit optimizer step since the last call left no version mark
    split = _prepare_prompt(self, kwargs)  # e.g. a vision-language model's image prompt: its own forward first
    request = split if isinstance(split, str) else _request(self, state, inputs, generation_config, hf_only, split[1])
    if isinstance(request, str):
        _warn_once(self, state, request)
        return type(self).generate(self, inputs, generation_config, streamer=streamer, **hf_only, **kwargs)
    # the call's forwards (prefill, captures) in the state's pass: the LoRA views stay from call to call while
    # the signature _request just checked holds (state.GenerationState.views_pass)
    with torch.no_grad(), forward_state.resumed(state.views_pass):
        return _decode(self, state, request, streamer, split[0])


def _warn_once(model: nn.Module, state: GenerationState, reason: str) -> None:
    if reason in state.warned:
        return
    state.warned.add(reason)
    text = f"model.generate runs Hugging Face's generate (slower) because {reason}."
    warnings.warn(text, UserWarning, stacklevel=4)
    banner = get_banner(model)
    if banner is not None:
        banner.note(text)


@dataclass
class _Request:
    """One generate call the fast path runs."""

    plan: DecoderPlan
    settings: Any
    input_ids: torch.Tensor
    attention_mask: Optional[torch.Tensor]
    max_new_tokens: int
    eos_ids: tuple[int, ...]
    pad_id: int
    mask_pad_id: Optional[int]  # the pad id HF infers a missing attention mask from
    min_new_tokens: int = 0  # EOS ids are banned until this many new tokens (min_new_tokens / min_length)


def _is_set(value: Any) -> bool:
    if value is None or value is False:
        return False
    try:
        return len(value) > 0
    except TypeError:
        return True


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        return tuple(int(v) for v in value.reshape(-1).tolist())
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _request(model: nn.Module, state: GenerationState, inputs: Any, generation_config: Any, hf_only: dict,
             kwargs: dict) -> _Request | str:
    """What this call asks for, or the reason it goes to Hugging Face's ``generate``."""
    if model.training:
        return ("the model is in training mode; call FastLanguageModel.for_inference(model) before generating "
                "(model.train() was called after for_inference, as trainers do: dropout is on)")
    plan = state.refresh(model)
    if not isinstance(plan, DecoderPlan):
        return plan
    given = [name for name, value in hf_only.items() if _is_set(value)]
    if given:
        return f"{given[0]} was passed (only Hugging Face's generate implements it)"
    if kwargs.get("custom_generate") is not None:
        return "custom_generate was passed"
    config, model_kwargs = prepare_generation_config(model, generation_config, dict(kwargs))
    input_ids = inputs if inputs is not None else model_kwargs.pop("input_ids", None)
    attention_mask = model_kwargs.pop("attention_mask", None)
    extra = sorted(name for name, value in model_kwargs.items() if value is not None)
    if extra:
        return f"{', '.join(extra)} {'was' if len(extra) == 1 else 'were'} passed (the fast path takes input_ids and attention_mask)"
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        return "no [batch, length] tensor of token ids was given (inputs_embeds, or no prompt)"
    mode = config.get_generation_mode(None)
    mode = getattr(mode, "value", str(mode))
    if mode not in _FAST_MODES:
        return f"the generation mode is {mode!r} (num_beams={config.num_beams})"
    for name, off in _OFF_VALUES.items():
        value = getattr(config, name, None)
        if value not in off and _is_set(value):
            return f"{name}={value!r} is set"
    try:
        settings = SamplingSettings.from_generation_config(config)
    except ValueError as exc:  # sampling.UnsupportedSettingError names the setting
        setting = getattr(exc, "setting", None)
        return f"{setting}={exc.value!r} is set" if setting is not None else str(exc).rstrip(".")
    copies = int(config.num_return_sequences or 1)
    if copies > 1:
        if not settings.do_sample:
            return f"num_return_sequences={copies} without sampling"
        input_ids = input_ids.repeat_interleave(copies, dim=0)
        attention_mask = None if attention_mask is None else attention_mask.repeat_interleave(copies, dim=0)
    if len(state.devices) > 1:  # read with the signature (state.refresh above)
        return f"the model is spread over {len(state.devices)} devices"
    if input_ids.device != plan.device():
        return f"input_ids are on {input_ids.device} but the model is on {plan.device()}"
    prompt = input_ids.shape[1]
    max_new = config.max_new_tokens if config.max_new_tokens is not None else (config.max_length or 20) - prompt
    if max_new < 1:
        asked = (f"max_new_tokens={config.max_new_tokens}" if config.max_new_tokens is not None
                 else f"max_length={config.max_length} after a prompt of {prompt} tokens")
        return f"{asked} asks for no new token"
    eos_ids = _ids(config.eos_token_id)
    pad = _ids(config.pad_token_id)
    pad_id = pad[0] if pad else (eos_ids[0] if eos_ids else 0)
    mask_pad = pad[0] if pad else (eos_ids[0] if eos_ids else None)
    # Hugging Face's MinNewTokensLength / MinLength processors: EOS scores are -inf until the row has
    # min_new_tokens new tokens, or until prompt + new tokens reach min_length (the prompt's padding counts)
    min_new = max(int(config.min_new_tokens or 0), int(config.min_length or 0) - prompt, 0)
    return _Request(plan, settings, input_ids, attention_mask, int(max_new), eos_ids, pad_id, mask_pad,
                    min(min_new, int(max_new)) if eos_ids else 0)


# --------------------------------------------------------------------------------------------------
# Checks of the prompt and the length
# --------------------------------------------------------------------------------------------------


def _attention_mask(request: _Request) -> torch.Tensor:
    """The given mask, or Hugging Face's default: ``input_ids != pad`` when the pad id occurs in the prompt
    and is no EOS id, else all ones."""
    ids = request.input_ids
    if request.attention_mask is not None:
        return request.attention_mask.to(ids.device)
    pad = request.mask_pad_id
    if pad is not None and pad not in request.eos_ids and bool((ids == pad).any()):
        return (ids != pad).long()
    return torch.ones_like(ids)


def left_pad_lengths(attention_mask: torch.Tensor) -> torch.Tensor:
    """Leading zeros of each row of a left-padded ``attention_mask`` ``[B, P]``; a readable ``ValueError``
    for right padding, gaps or empty rows."""
    mask = attention_mask.bool()
    batch, prompt = mask.shape
    pad = (~mask).long().cumprod(dim=1).sum(dim=1)
    expected = torch.arange(prompt, device=mask.device)[None, :] >= pad[:, None]
    if bool((mask == expected).all()) and bool((pad < prompt).all()):
        return pad
    bad = int((~(mask == expected).all(dim=1) | (pad >= prompt)).nonzero()[0])
    if not bool(mask[bad].any()):
        raise ValueError(f"Row {bad} of attention_mask is all zeros: every prompt needs at least one token.")
    if not bool(mask[bad, -1]):
        raise ValueError(
            f"Row {bad} of the batch is padded on the right (its attention_mask ends in 0). Generation continues "
            "each row after its last column, so batches must be padded on the left: set "
            'tokenizer.padding_side = "left" before tokenizing the prompts.'
        )
    raise ValueError(
        f"Row {bad} of attention_mask has zeros between ones; only left padding (zeros first, then ones) is "
        'supported: tokenize the prompts with tokenizer.padding_side = "left".'
    )


def _length_limit(model: nn.Module) -> int:
    limit = model.__dict__.get("max_seq_length")
    if limit is None:
        limit = getattr(model.config, "max_position_embeddings", None) or 2048
    return int(limit)


def _check_length(model: nn.Module, prompt: int, max_new: int) -> int:
    limit = _length_limit(model)
    need = prompt + max_new
    if need > limit:
        room = limit - prompt
        advice = (f"Lower max_new_tokens to {room} or less, or reload" if room > 0 else "Shorten the prompt, or reload")
        raise ValueError(
            f"max_new_tokens={max_new} after a prompt of {prompt} tokens needs {need} positions, more than "
            f"max_seq_length={limit} (the size limit of the static KV cache). {advice} the model with "
            f"FastLanguageModel.from_pretrained(..., max_seq_length={need})."
        )
    return limit


# --------------------------------------------------------------------------------------------------
# Cache and buffers
# --------------------------------------------------------------------------------------------------


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def bucket_for(length: int, capacity: int) -> int:
    """Cache slots the decode step reads when slots ``0 .. length - 1`` are in use: the smallest power
    of two (at least ``MIN_BUCKET``) covering them, capped at ``capacity``."""
    return min(capacity, max(MIN_BUCKET, _next_power_of_two(length)))


def cache_capacity(need: int, limit: int, current: int = 0) -> int:
    """Slots of the KV cache allocated for a request that needs ``need`` (prompt + max_new_tokens):
    ``need`` rounded up to a multiple of ``CACHE_ROUNDING``, never less than the ``current`` cache's,
    at most ``limit`` (max_seq_length). The cache only grows while the model keeps it, so requests of
    slightly different lengths (GRPO's prompts) reuse one cache and its captured graphs."""
    rounded = _round_up(need, CACHE_ROUNDING)
    return max(need, min(limit, max(rounded, current)))


def _cache_for(state: GenerationState, plan: DecoderPlan, batch: int, need: int, limit: int) -> StaticKVCache:
    """The state's cache if it fits, else a new one (the old one freed first) of
    :func:`cache_capacity` slots and the larger of the two batch sizes."""
    dtype, device = plan.hidden_dtype(), plan.device()
    cache = state.cache
    if cache is not None and cache.fits(batch, need, dtype, device):
        return cache
    same_kind = cache is not None and cache.dtype == dtype and cache.device == torch.device(device)
    rows = max(batch, cache.batch if same_kind else 0)
    capacity = cache_capacity(need, limit, cache.capacity if same_kind else 0)
    state.drop_cache()
    state.cache = StaticKVCache(len(plan.layers), rows, plan.kv_heads, plan.head_dim, capacity, dtype, device)
    return state.cache


class DecodeBuffers:
    """The static tensors of the decode loop for one batch size (the captured steps read and write them)."""

    def __init__(self, batch: int, capacity: int, vocab: int, device: torch.device) -> None:
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)  # the step's input token
        self.slot = torch.zeros(1, dtype=torch.long, device=device)  # the step's slot
        self.pad = torch.zeros(batch, dtype=torch.long, device=device)  # left padding per row
        self.offset = torch.zeros(batch, dtype=torch.long, device=device)  # RoPE position offset per row
        self.unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        self.ids = torch.zeros(batch, capacity, dtype=torch.long, device=device)  # prompt + new tokens, by slot
        self.seen = torch.zeros(batch, vocab, dtype=torch.bool, device=device)  # for the repetition penalty
        self.min_slot = torch.zeros(1, dtype=torch.long, device=device)  # EOS banned while slot < min_slot
        self._stops: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def stop_tensors(self, eos_ids: tuple[int, ...], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Device tensors of the EOS ids and the pad id (kept: captured steps read them)."""
        key = (eos_ids, pad_id)
        if key not in self._stops:
            device = self.ids.device
            self._stops[key] = (torch.tensor(eos_ids, dtype=torch.long, device=device).reshape(-1),
                                torch.tensor(pad_id, dtype=torch.long, device=device))
        return self._stops[key]

    def advanced(self) -> tuple[torch.Tensor, ...]:
        """The tensors a step advances in place (restored after a graph's warm-up run)."""
        return self.tokens, self.slot, self.unfinished, self.seen


def _buffers_for(state: GenerationState, batch: int, cache: StaticKVCache, vocab: int) -> DecodeBuffers:
    buffers = state.buffers.get(batch)
    if buffers is None or buffers.ids.shape[1] != cache.capacity or buffers.seen.shape[1] != vocab:
        buffers = DecodeBuffers(batch, cache.capacity, vocab, cache.device)
        state.buffers[batch] = buffers
    return buffers


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------


def _advance(buffers: DecodeBuffers, logits: torch.Tensor, settings: Any, eos: torch.Tensor, pad: torch.Tensor,
             ban_eos_early: bool = False) -> None:
    """Choose the next token of every row from ``logits`` ``[B, V]`` and store it at slot ``slot + 1``
    (graph-safe: everything on the device, in place). With ``ban_eos_early`` the EOS scores are -inf
    while ``slot < min_slot`` (before the filters, as Hugging Face's min-length processors run
    before its warpers; -inf stays -inf through every filter)."""
    logits = logits.float()
    if ban_eos_early and eos.numel():
        early = buffers.slot < buffers.min_slot  # [1]
        logits = logits.index_fill(1, eos, float("-inf")).where(early[:, None], logits)
    scores = filter_logits(logits, buffers.seen, settings)
    uniform = torch.rand(scores.shape, device=scores.device) if settings.do_sample else None
    chosen = choose_next(scores, settings, uniform)
    chosen = torch.where(buffers.unfinished, chosen, pad)
    buffers.ids.index_copy_(1, buffers.slot + 1, chosen[:, None])
    mark_seen(buffers.seen, chosen)
    if eos.numel():
        buffers.unfinished &= ~(chosen[:, None] == eos).any(dim=1)
    buffers.tokens.copy_(chosen)
    buffers.slot += 1


def _decode(model: nn.Module, state: GenerationState, request: _Request, streamer: Any,
            prefill: Optional[Prefill] = None) -> torch.Tensor:
    plan = request.plan
    input_ids = request.input_ids
    batch, prompt = input_ids.shape
    pad_lengths = left_pad_lengths(_attention_mask(request))
    limit = _check_length(model, prompt, request.max_new_tokens)
    need = prompt + request.max_new_tokens
    # a call after drop_cache captures one graph for the whole request (module docstring)
    one_graph, state.dropped = state.cache is None and state.dropped, False
    cache = _cache_for(state, plan, batch, need, limit)
    buffers = _buffers_for(state, batch, cache, plan.vocab_size)
    eos, pad = buffers.stop_tensors(request.eos_ids, request.pad_id)
    settings = request.settings

    buffers.ids[:, :prompt].copy_(input_ids)
    buffers.pad.copy_(pad_lengths)
    buffers.unfinished.fill_(True)
    # The repetition penalty counts the prompt without its left padding, as Hugging Face (transformers 5) does.
    buffers.seen.copy_(new_seen_mask(input_ids, plan.vocab_size, pad_lengths))
    buffers.slot.fill_(prompt - 1)
    ban_eos = request.min_new_tokens > 0
    buffers.min_slot.fill_(prompt - 1 + request.min_new_tokens)  # choosing at slot s: s - prompt + 1 new tokens so far
    if streamer is not None:
        streamer.put(input_ids.cpu())

    if prefill is None:
        logits, offsets = cached_forward(model, input_ids, cache, 0, buffers.pad), None
    else:  # the model's own prefill (a vision-language prompt: its forward), and the RoPE offsets it leaves (or None)
        logits, offsets = prefill(model, input_ids, cache, 0, buffers.pad)
    if offsets is not None:
        buffers.offset.copy_(offsets)
    step_offsets = buffers.offset if offsets is not None else None
    _advance(buffers, logits, settings, eos, pad, ban_eos)
    del logits
    if streamer is not None:
        streamer.put(buffers.ids[:, prompt].cpu())

    def step(kv_length: int) -> Callable[[], None]:
        def run() -> None:
            step_logits = cached_forward(model, buffers.tokens[:, None], cache, buffers.slot, buffers.pad, kv_length,
                                         position_offsets=step_offsets)
            _advance(buffers, step_logits, settings, eos, pad, ban_eos)
        return run

    check_every = 1 if streamer is not None or not graphs_enabled(cache.device) else CHECK_EVERY_GPU
    generated = 1
    for i in range(1, request.max_new_tokens):
        if i % check_every == 0 and request.eos_ids and not bool(buffers.unfinished.any()):
            break
        slot = prompt + i - 1
        kv_length = min(cache.capacity, _round_up(need, MIN_BUCKET)) if one_graph else \
            bucket_for(slot + 1, cache.capacity)
        key = (batch, kv_length, settings, request.eos_ids, request.pad_id, ban_eos, step_offsets is not None)
        state.runner.run(key, step(kv_length), cache.device, buffers.advanced())
        generated += 1
        if streamer is not None:
            streamer.put(buffers.ids[:, slot + 1].cpu())
    if streamer is not None:
        streamer.end()
    length = _returned_length(buffers.ids[:, prompt:prompt + generated], eos)
    return buffers.ids[:, :prompt + length].clone()


def _returned_length(new_ids: torch.Tensor, eos: torch.Tensor) -> int:
    """How many new tokens Hugging Face returns: up to the step where the last row stopped (its first
    EOS id), or all of them when some row never stopped."""
    generated = new_ids.shape[1]
    if eos.numel() == 0:
        return generated
    stops = (new_ids[..., None] == eos).any(dim=-1)  # [B, N]
    if not bool(stops.any(dim=1).all()):
        return generated
    return int(stops.int().argmax(dim=1).max()) + 1  # argmax: the first stop of each row
