"""The trainer classes are module-level classes of modules that import TRL, and those modules load only when
a trainer is first asked for: ``import notebookkit`` / ``notebookkit.train`` and the data checks stay light."""

from __future__ import annotations

import subprocess
import sys

import pytest

from notebookkit.training_methods import TRAINING_METHODS


def test_package_and_data_checks_import_without_trl():
    code = ("import sys, notebookkit, notebookkit.train\n"
            "from notebookkit.train import check_grpo_dataset, check_preference_dataset, GRPOInputError, "
            "PreferenceInputError\n"
            "heavy = sorted(m for m in ('trl', 'torch', 'transformers') if m in sys.modules)\n"
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", [n for n in TRAINING_METHODS if n != "sft"])
def test_trainer_is_a_module_level_class(name):
    pytest.importorskip("trl")
    import importlib

    import notebookkit.train as train

    cls = getattr(train, TRAINING_METHODS[name].trainer)
    module = importlib.import_module(cls.__module__)
    assert cls.__qualname__ == cls.__name__ == TRAINING_METHODS[name].trainer
    assert getattr(module, cls.__name__) is cls and cls.__module__ == f"notebookkit.train.{name}"
