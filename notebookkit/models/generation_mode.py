"""``generation_mode(model)``: a block that generates with a notebookkit model, then puts it back as it was.

Evaluation helpers (exact match, answer loss, caption replies) generate in the middle of a
notebook, often between training runs. Inside the block the model is in eval mode under
``torch.no_grad()``, and a model loaded by notebookkit (it carries a banner) is switched with its
API's ``for_inference``, so ``model.generate`` is the fast decode path. After the block it is
exactly what it was: ``for_training`` when it was training, Hugging Face's ``generate`` again when
it had not been switched before. A model from elsewhere only gets ``eval()`` and its mode back.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

__all__ = ["generation_mode"]


@contextlib.contextmanager
def generation_mode(model: Any, api: Any = None) -> Iterator[None]:
    """Eval mode and the fast ``generate`` for the block (see the module docstring).

    ``api`` is the class whose ``for_inference`` / ``for_training`` switch the model
    (``FastLanguageModel`` when left out; ``FastVisionModel`` for a vision-language model).
    """
    import torch

    from .common.banner import get_banner
    from .generation import is_bound, unbind_generate

    if api is None:
        from .fast_language_model import FastLanguageModel as api
    was_training = model.training
    fast = get_banner(model) is not None
    was_bound = fast and is_bound(model)
    if fast:
        api.for_inference(model)
    else:
        model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        if fast and was_training:
            api.for_training(model)
        else:
            if fast and not was_bound:
                unbind_generate(model)
            model.train(was_training)
