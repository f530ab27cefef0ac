"""One load pipeline, two variants: the public ``from_pretrained`` of text and vision models share
:func:`notebookkit.models.loading.loader.load`, and the generic decoder imports nothing of vision."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from notebookkit.models import FastLanguageModel, FastVisionModel
from notebookkit.models.loading.loader import LOAD_KEYWORDS, TEXT_MODEL, load
from notebookkit.models.vision.loader import VISION_MODEL

GENERATION = Path(__file__).resolve().parents[2] / "notebookkit" / "models" / "generation"


@pytest.mark.parametrize("api, variant", [(FastLanguageModel, TEXT_MODEL), (FastVisionModel, VISION_MODEL)])
def test_each_from_pretrained_takes_the_pipelines_keywords(api, variant):
    signature = inspect.signature(api.from_pretrained)
    assert list(signature.parameters) == [*LOAD_KEYWORDS, "kwargs"]
    assert signature.parameters["model_name"].default == variant.default_model_name
    for name in LOAD_KEYWORDS[1:]:
        assert signature.parameters[name].default == inspect.signature(load).parameters[name].default
        assert f"{name}:" in api.from_pretrained.__doc__, f"{name} is not documented"


def test_from_pretrained_binds_positional_arguments_as_before():
    with pytest.raises(ValueError, match="max_seq_length=0 is not a positive whole number"):
        FastLanguageModel.from_pretrained("notebookkit/tiny-llama", 0)
    with pytest.raises(TypeError, match="multiple values for argument 'max_seq_length'"):
        FastLanguageModel.from_pretrained("notebookkit/tiny-llama", 64, max_seq_length=64)


def test_generation_imports_no_vision_module():
    for path in GENERATION.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []  # module names, and what a ``from`` import takes (a module when imported from a package)
            if isinstance(node, ast.ImportFrom):
                names = [*(node.module or "").split("."), *(a.name for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [part for a in node.names for part in a.name.split(".")]
            vision = [n for n in names if n.startswith(("vision", "patch_vision", "fast_vision"))]
            assert not vision, f"{path.name}:{node.lineno} imports {vision}"


def test_the_vision_variant_differs_in_hooks_only():
    """The two rows of the record: every hook of the vision row is its own (none falls back to the text row's)."""
    same = [f for f in ("resolve", "check_config", "model_class", "load_processor", "tokenizer_of", "saved_processor",
                        "patch", "on_adapter", "on_loaded") if getattr(TEXT_MODEL, f) is getattr(VISION_MODEL, f)]
    assert same == []
