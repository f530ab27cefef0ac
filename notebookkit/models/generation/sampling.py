"""The next token of every row: Hugging Face's logits processors as graph-safe tensor ops.

At each decode step row ``b`` has the logits ``x`` (fp32, ``V`` entries) of its last position and
the set ``S_b`` of tokens it has seen (its prompt without the left padding, and what it generated).
The next token is chosen as Hugging Face's ``generate`` chooses it, with its filters in its order:

1. repetition penalty ``p`` (when ``p != 1``), on seen tokens only, greedy or sampling::

       x_i <- x_i * p  if x_i < 0  else  x_i / p          for i in S_b

   and only when sampling (``do_sample=True``), each on the output of the one before:
2. temperature ``t`` (when ``t != 1``): ``x <- x / t``;
3. top-k (when ``k > 0``): drop every ``x_i`` below the k-th largest value (all ties with it stay);
4. top-p (when ``top_p < 1``): sort ``x`` ascending, ``c = cumsum(softmax(sorted x))``, drop the
   tokens with ``c <= 1 - top_p``; the token whose probability crosses the threshold stays, and
   so does the most likely one (``min_tokens_to_keep = 1``);
5. min-p (when ``min_p > 0``): drop tokens with ``softmax(x)_i < min_p * max_j softmax(x)_j``.

A dropped token's logit becomes ``-inf``. Greedy decoding takes ``argmax x`` (the first maximum,
as ``torch.argmax``). Sampling draws from ``softmax(x)`` by the Gumbel-max trick: with uniforms
``u_i`` in (0, 1), ``g_i = -log(-log u_i)`` is Gumbel(0, 1) distributed and
``P(argmax_i (x_i + g_i) = j) = softmax(x)_j``. The caller provides the uniforms, so the random
numbers come from its own generator (in a CUDA graph: ``torch.rand`` into a static buffer).

Graph safety: every function runs a fixed sequence of tensor ops whose shapes depend only on the
input shapes and on the settings (plain Python numbers, fixed when a graph is captured: new
settings, new capture). None reads a tensor value on the host (no ``.item()``, ``bool(tensor)``,
``nonzero`` or boolean indexing), so a CUDA graph replays them with new logits.

:meth:`SamplingSettings.from_generation_config` reads a ``transformers.GenerationConfig`` with Hugging
Face's names and defaults; a setting this path does not run (beam search, ``typical_p``,
``no_repeat_ngram_size``, ...) raises :class:`UnsupportedSettingError`, a ``ValueError`` naming it,
so the caller can hand the call to Hugging Face's own ``generate``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = [
    "SamplingSettings", "UnsupportedSettingError", "new_seen_mask", "mark_seen", "filter_logits", "choose_next",
]

# Hugging Face's values for settings its GenerationConfig leaves unset (GenerationConfig's global defaults).
HF_DEFAULTS: dict[str, Any] = {
    "do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None, "repetition_penalty": 1.0,
}


def _positive(value: Any) -> bool:
    return value is not None and value > 0


def _set(value: Any) -> bool:
    return value is not None


def _not(off: Any) -> Callable[[Any], bool]:
    return lambda value: value is not None and value != off


# Settings that change the chosen token in Hugging Face's generate and that this path does not run
# (min_length / min_new_tokens are the decode loop's: notebookkit.models.generation.generate):
# (name, "does it act?", what Hugging Face does with it). Sampling-only filters act only with do_sample.
_UNSUPPORTED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("num_beams", lambda v: v is not None and v > 1, "beam search"),
    ("num_beam_groups", lambda v: v is not None and v > 1, "group beam search"),
    ("diversity_penalty", _not(0.0), "group beam search"),
    ("penalty_alpha", _positive, "contrastive search"),
    ("dola_layers", _set, "DoLa decoding"),
    ("prompt_lookup_num_tokens", _set, "prompt-lookup decoding"),
    ("no_repeat_ngram_size", _positive, "the n-gram repetition ban"),
    ("encoder_no_repeat_ngram_size", _positive, "the encoder n-gram ban"),
    ("encoder_repetition_penalty", _not(1.0), "the encoder repetition penalty"),
    ("bad_words_ids", _set, "banned token sequences"),
    ("sequence_bias", _set, "sequence biases"),
    ("forced_bos_token_id", _set, "a forced first token"),
    ("forced_eos_token_id", _set, "a forced last token"),
    ("remove_invalid_values", lambda v: v is True, "replacing NaN/inf logits"),
    ("exponential_decay_length_penalty", _set, "the length penalty on EOS"),
    ("suppress_tokens", _set, "suppressed tokens"),
    ("begin_suppress_tokens", _set, "tokens suppressed at the start"),
    ("guidance_scale", _not(1.0), "classifier-free guidance"),
    ("watermarking_config", _set, "watermarking"),
    ("renormalize_logits", lambda v: v is True, "renormalised scores"),
)
_UNSUPPORTED_WHEN_SAMPLING: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("typical_p", lambda v: v is not None and v < 1.0, "typical sampling"),
    ("epsilon_cutoff", lambda v: v is not None and 0.0 < v < 1.0, "epsilon sampling"),
    ("eta_cutoff", lambda v: v is not None and 0.0 < v < 1.0, "eta sampling"),
    ("top_h", _set, "top-H sampling"),
)


class UnsupportedSettingError(ValueError):
    """A generation setting the fast decode path does not run; ``setting`` names it.

    The fast path's caller catches it and runs Hugging Face's own ``generate`` instead.
    """

    def __init__(self, setting: str, value: Any, what: str):
        super().__init__(
            f"notebookkit's fast generation does not run {what} (`{setting}={value!r}`), so this call uses "
            f"Hugging Face's generate instead; unset `{setting}` to decode on the fast path."
        )
        self.setting = setting
        self.value = value


@dataclass(frozen=True)
class SamplingSettings:
    """How the next token is chosen: greedy, or sampled after Hugging Face's filters.

    ``temperature``, ``top_k`` (0 = off), ``top_p`` (1.0 = off) and ``min_p`` (0.0 = off) act only
    with ``do_sample=True``; ``repetition_penalty`` (1.0 = off) acts in both modes, as in Hugging
    Face. Frozen and hashable: a CUDA graph captured for one settings object serves every equal one.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.do_sample and not self.temperature > 0:
            raise ValueError(
                f"temperature must be > 0 when sampling (got {self.temperature!r}); for greedy decoding "
                "set do_sample=False."
            )
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k must be a whole number >= 0, 0 turning it off (got {self.top_k!r}).")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be between 0 and 1, 1 turning it off (got {self.top_p!r}).")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be between 0 and 1, 0 turning it off (got {self.min_p!r}).")
        if not self.repetition_penalty > 0:
            raise ValueError(
                f"repetition_penalty must be > 0, 1 turning it off (got {self.repetition_penalty!r})."
            )

    @property
    def needs_seen_mask(self) -> bool:
        """Whether :func:`filter_logits` reads the seen-token mask (the repetition penalty is on)."""
        return self.repetition_penalty != 1.0

    @property
    def needs_uniforms(self) -> bool:
        """Whether :func:`choose_next` reads uniforms (sampling)."""
        return self.do_sample

    @classmethod
    def from_generation_config(cls, generation_config: Any = None, **overrides: Any) -> "SamplingSettings":
        """The settings a ``transformers.GenerationConfig`` asks for, with ``generate``'s keywords on top.

        Args:
            generation_config: the config ``generate`` would use (a ``GenerationConfig``, any object
                with its attribute names, or a dict); ``None`` means Hugging Face's defaults.
                Unset (``None``) fields take Hugging Face's defaults: greedy, temperature 1,
                ``top_k=50``, top-p and min-p off, no repetition penalty.
            **overrides: ``generate``'s keyword arguments with Hugging Face's names (``do_sample``,
                ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``, and any other
                setting, which is checked as below). As in ``generate``, an override of ``None``
                turns its filter off.

        Raises:
            UnsupportedSettingError: a setting that changes the chosen token and that this path
                does not run (``num_beams > 1``, ``typical_p < 1``, ``epsilon_cutoff``,
                ``no_repeat_ngram_size``, ``bad_words_ids``, ...); its ``setting`` attribute names it.
            ValueError: a value Hugging Face would refuse too (``temperature=0`` when sampling, ...).

        With ``do_sample=False`` the sampling filters are stored as off, so every greedy setting
        compares equal (one captured graph).
        """
        def read(name: str) -> Any:
            if name in overrides:
                return overrides[name]
            if isinstance(generation_config, dict):
                value = generation_config.get(name)
            else:
                value = getattr(generation_config, name, None)
            return HF_DEFAULTS.get(name) if value is None else value

        do_sample = bool(read("do_sample"))
        for name, acts, what in _UNSUPPORTED + (_UNSUPPORTED_WHEN_SAMPLING if do_sample else ()):
            value = read(name)
            if acts(value):
                raise UnsupportedSettingError(name, value, what)
        penalty = read("repetition_penalty")
        penalty = 1.0 if penalty is None else float(penalty)
        if not do_sample:
            return cls(do_sample=False, repetition_penalty=penalty)
        temperature, top_k, top_p, min_p = (read(n) for n in ("temperature", "top_k", "top_p", "min_p"))
        return cls(
            do_sample=True,
            temperature=1.0 if temperature is None else float(temperature),
            top_k=0 if top_k is None else top_k,
            top_p=1.0 if top_p is None else float(top_p),
            min_p=0.0 if min_p is None else float(min_p),
            repetition_penalty=penalty,
        )


def new_seen_mask(
    input_ids: torch.LongTensor, vocab_size: int, pad_lengths: torch.LongTensor | None = None
) -> torch.BoolTensor:
    """``seen[b, i]``: token ``i`` occurs in row ``b`` of ``input_ids`` ``[B, T]``; a ``[B, V]`` bool tensor.

    ``pad_lengths`` ``[B]`` (optional): row ``b``'s first ``pad_lengths[b]`` positions are left
    padding and are not counted. Hugging Face's ``generate`` (transformers 5) skips the left
    padding that the attention mask marks; without ``pad_lengths`` every position counts. Ids
    ``>= vocab_size`` (an embedding table larger than the LM head) are not counted either, as in
    Hugging Face. The repetition penalty acts on the tokens marked here.
    """
    batch, length = input_ids.shape
    ids = input_ids.clamp(max=vocab_size)  # column vocab_size collects what is not counted
    if pad_lengths is not None:
        positions = torch.arange(length, device=input_ids.device)
        ids = ids.masked_fill(positions[None, :] < pad_lengths.to(input_ids.device)[:, None], vocab_size)
    seen = torch.zeros(batch, vocab_size + 1, dtype=torch.bool, device=input_ids.device)
    seen.scatter_(1, ids, True)
    return seen[:, :vocab_size].contiguous()


def mark_seen(seen: torch.BoolTensor, next_ids: torch.LongTensor) -> None:
    """Mark ``next_ids`` ``[B]`` (each ``< V``) as seen in ``seen`` ``[B, V]``, in place."""
    seen.scatter_(1, next_ids.reshape(-1, 1), True)


def filter_logits(logits: torch.Tensor, seen: torch.BoolTensor | None, s: SamplingSettings) -> torch.Tensor:
    """Hugging Face's logits processors on ``logits`` ``[B, V]``: the penalised, filtered fp32 logits.

    Repetition penalty (needs ``seen`` ``[B, V]``, see :func:`new_seen_mask`), then, when
    ``s.do_sample``: temperature, top-k, top-p, min-p (module docstring). Dropped tokens are
    ``-inf``. Computes in fp32, as ``generate`` does; returns ``logits`` itself when it is fp32 and
    nothing applies.
    """
    x = logits.float()
    if s.repetition_penalty != 1.0:
        if seen is None:
            raise ValueError("filter_logits: repetition_penalty is on, so it needs the seen-token mask (new_seen_mask).")
        x = _repetition_penalty(x, seen, s.repetition_penalty)
    if not s.do_sample:
        return x
    if s.temperature != 1.0:
        x = x / s.temperature
    if s.top_k > 0:
        x = _top_k(x, int(s.top_k))
    if s.top_p < 1.0:
        x = _top_p(x, s.top_p)
    if s.min_p > 0.0:
        x = _min_p(x, s.min_p)
    return x


def choose_next(logits: torch.Tensor, s: SamplingSettings, uniform: torch.Tensor | None = None) -> torch.LongTensor:
    """The next token of each row of ``logits`` ``[B, V]`` (already filtered): ``[B]`` int64.

    Greedy (``s.do_sample=False``): ``argmax`` (the first maximum). Sampling: a draw from
    ``softmax(logits)`` given ``uniform`` ``[B, V]`` in [0, 1) (``torch.rand``):
    ``argmax(logits - log(-log u))``; ``u`` is clamped into the open interval so that every
    ``-inf`` logit stays unchosen.
    """
    if not s.do_sample:
        return torch.argmax(logits, dim=-1)
    if uniform is None:
        raise ValueError("choose_next: sampling needs uniforms [B, V] (torch.rand from the caller's generator).")
    info = torch.finfo(uniform.dtype)
    u = uniform.clamp(min=info.tiny, max=1.0 - info.eps / 2)
    gumbel = -torch.log(-torch.log(u))
    return torch.argmax(logits + gumbel, dim=-1)


def _repetition_penalty(x: torch.Tensor, seen: torch.BoolTensor, penalty: float) -> torch.Tensor:
    """Seen tokens: negative logits times ``penalty``, the others divided by it."""
    penalised = torch.where(x < 0, x * penalty, x / penalty)
    return torch.where(seen, penalised, x)


def _top_k(x: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the logits at least as large as the k-th largest (ties with it included)."""
    k = min(k, x.shape[-1])
    kth = torch.topk(x, k, dim=-1).values[..., -1:]
    return x.masked_fill(x < kth, float("-inf"))


def _top_p(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the most likely tokens whose probabilities reach ``top_p``: drop those whose ascending
    cumulative probability is at most ``1 - top_p``, never the most likely one."""
    ascending, order = torch.sort(x, descending=False)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative <= 1 - top_p
    drop_sorted[..., -1:] = False
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return x.masked_fill(drop, float("-inf"))


def _min_p(x: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens less likely than ``min_p`` times the most likely one, never the most likely one."""
    probs = torch.softmax(x, dim=-1)
    drop = probs < min_p * probs.amax(dim=-1, keepdim=True)
    drop.scatter_(-1, torch.topk(probs, 1, dim=-1).indices, False)
    return x.masked_fill(drop, float("-inf"))
