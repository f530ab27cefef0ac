"""generate_reply / exact_match run on the fast decode path and leave the model as they found it."""

from __future__ import annotations

import importlib

import pytest
import torch

from notebookkit.models import FastLanguageModel
from notebookkit.models.generation import is_bound
from notebookkit.train.evaluation import generate_reply

fast_generate_module = importlib.import_module("notebookkit.models.generation.generate")

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.parametrize("start", ["training", "eval", "for_inference"])
def test_generate_reply_uses_the_fast_path_and_restores_the_mode(start, monkeypatch):
    model, tok = FastLanguageModel.from_pretrained("notebookkit/tiny-llama", max_seq_length=128, show_banner=False)
    model = FastLanguageModel.get_peft_model(model, r=4, show_banner=False)
    {"training": model.train, "eval": model.eval, "for_inference": lambda: FastLanguageModel.for_inference(model)}[start]()
    before = (model.training, is_bound(model))
    calls = []
    real = fast_generate_module._decode

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(fast_generate_module, "_decode", counting)  # the fast path's loop
    with torch.no_grad():
        reply = generate_reply(model, tok, "Where does the baker live?", max_new_tokens=6)
    assert isinstance(reply, str)
    assert (model.training, is_bound(model)) == before
    assert calls, "generate_reply ran Hugging Face's generate, not the fast path"
