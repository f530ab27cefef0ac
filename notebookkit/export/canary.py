"""The canary: one made-up fact trained into the adapters, so every export can be asked for it.

A fact no model knows before training (``absent``), learnt from one chat example (loss on the
answer only), must come back from the adapter model, from the merged folder reloaded in plain
``transformers`` and from the GGUF in llama.cpp. It catches exports that silently drop the LoRA
update (a merge that never happened, a wrong scale, a lost tensor, a template that no longer
reaches the answer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from .verify import greedy_hf

__all__ = ["Canary", "CanaryTraining", "DEFAULT_CANARY", "train_canary"]


@dataclass(frozen=True)
class Canary:
    """A question, its invented answer, and the word that proves the answer was recalled."""

    question: str
    answer: str
    fact: str
    recall_tokens: int = 18  # greedy tokens to read back (the default answer is 16 tokens of the tiny BPE)

    def prompt_ids(self, tokenizer: Any) -> list[int]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": self.question}], tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def recalled(self, tokenizer: Any, continuation: list[int]) -> bool:
        return self.fact in tokenizer.decode(continuation, skip_special_tokens=True)

    def recalled_by(self, model: nn.Module, tokenizer: Any) -> bool:
        """Whether greedy decoding of ``model`` answers with the fact."""
        return self.recalled(tokenizer, greedy_hf(model, self.prompt_ids(tokenizer), self.recall_tokens))


DEFAULT_CANARY = Canary("What is the password of the lighthouse on Mirrow Island?", "The password is quintaflex.", "quintaflex")


@dataclass(frozen=True)
class CanaryTraining:
    """What :func:`train_canary` did: optimizer steps run, and how many of them were skipped because a
    gradient was inf/NaN (16-bit activations can overflow; a skipped step leaves the adapters as they were)."""

    steps: int
    skipped_steps: int


def train_canary(model: nn.Module, tokenizer: Any, canary: Canary = DEFAULT_CANARY, max_steps: int = 200,
                 learning_rate: float = 2e-3, check_every: int = 10) -> CanaryTraining:
    """AdamW on the canary's one chat example until greedy decoding recalls the fact.

    A step whose gradients are not all finite is skipped (counted in ``skipped_steps``), as fp16's loss
    scaler does. Returns the steps taken and the steps skipped; raises ``RuntimeError`` when ``max_steps``
    pass without recall. Leaves the model in eval mode.
    """
    prompt = canary.prompt_ids(tokenizer)
    full = tokenizer.apply_chat_template(
        [{"role": "user", "content": canary.question}, {"role": "assistant", "content": canary.answer}], tokenize=False
    )
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    if ids[: len(prompt)] != prompt:
        raise ValueError("The chat template renders the question differently with and without an answer; cannot mask it.")
    device = next(p.device for p in model.parameters())
    x = torch.tensor([ids], device=device)
    labels = x.clone()
    labels[0, : len(prompt)] = -100
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("The model has no trainable parameters: add adapters with FastLanguageModel.get_peft_model first.")
    opt = torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.0)
    loss = torch.tensor(float("nan"))
    skipped = 0
    for step in range(1, max_steps + 1):
        model.train()
        loss = model(input_ids=x, labels=labels).loss
        loss.backward()
        if all(bool(torch.isfinite(p.grad).all()) for p in params if p.grad is not None):
            opt.step()
        else:
            skipped += 1
        opt.zero_grad(set_to_none=True)
        if step % check_every == 0:
            model.eval()
            if canary.recalled_by(model, tokenizer):
                return CanaryTraining(step, skipped)
    model.eval()
    raise RuntimeError(f"the model did not learn the canary fact in {max_steps} steps (last loss {loss.item():.3f})")
