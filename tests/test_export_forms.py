"""Every row of the export-form record (``notebookkit.export_forms``) is known to every consumer.

A form or GGUF type added to the table without one of its consumers fails here: the writers
(``save_method`` values, GGUF quantisation methods and their ``gguf`` encodings), the model methods
(bind) and the upload (hub), the reload checks and their tolerances (verify), the report, the memory
model (memory/export) and the export panel.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from notebookkit import export as export_package
from notebookkit.export.bind import EXPORT_METHODS
from notebookkit.export.checks import ExportError
from notebookkit.export.gguf_file import GGUF_METHODS, KQUANT_METHODS, normalize_quantization_methods
from notebookkit.export.merged import SAVE_METHODS
from notebookkit.export.report import export_and_verify
from notebookkit.export.verify import CHECKS, GGUF_TOLERANCE
from notebookkit.export_forms import EXPORT_FORMS, GGUF_TYPES, export_form
from notebookkit.memory.export import layer_working_bytes
from notebookkit.widgets.export_panel import GGUF_CHOICES, ExportPanel

FORMS = list(EXPORT_FORMS)
TYPES = list(GGUF_TYPES)


def test_record_imports_without_torch():
    code = "import sys, notebookkit.export_forms; assert 'torch' not in sys.modules and 'gguf' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_lookup():
    assert export_form("gguf").quantized
    with pytest.raises(ValueError, match="the forms are: lora"):
        export_form("awq")


@pytest.mark.parametrize("name", FORMS)
def test_writer_and_upload_are_model_methods(name):
    form = EXPORT_FORMS[name]
    assert form.writer in EXPORT_METHODS and form.hub in EXPORT_METHODS
    assert callable(getattr(export_package, form.writer)) and callable(getattr(export_package, form.hub))
    if form.writer == "save_pretrained_merged":
        assert name in SAVE_METHODS
    else:
        assert form.quantized, f"{name}: a form written by {form.writer} is not a save_method"


@pytest.mark.parametrize("name", FORMS)
def test_upload_checks_the_form_before_the_network(name, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    form = EXPORT_FORMS[name]
    push = getattr(export_package, form.hub)
    kwargs = {"quantization_method": "q8_0"} if form.quantized else {"save_method": name}
    with pytest.raises(ExportError, match="offline"):  # the form passed; the network check stopped it
        push(object(), "me/model", None, **kwargs)


@pytest.mark.parametrize("name", FORMS)
def test_reload_check_exists(name):
    form = EXPORT_FORMS[name]
    assert form.check is None or callable(CHECKS[form.check])


@pytest.mark.parametrize("name", FORMS)
def test_memory_model_counts_the_form(name):
    form = EXPORT_FORMS[name]
    working = layer_working_bytes(name, 64, 32, 4)
    assert working == 0 if form.memory == "adapter" else working > 64 * 32 * 4


@pytest.mark.parametrize("name", FORMS)
def test_panel_offers_the_labelled_forms(name):
    panel = ExportPanel()
    labels = dict(zip(panel.forms._options_values, panel.forms._options_labels))
    form = EXPORT_FORMS[name]
    assert (name in labels) == bool(form.label)
    if form.label:
        assert labels[name] == form.label


class _Recorder:
    """Stands for a model: records the writer calls the report makes and returns results like theirs."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def _result(self, form: str, path: Path):
        return SimpleNamespace(form=form, path=path, bytes_on_disk=1, measurements={})

    def save_pretrained_merged(self, folder, tokenizer, save_method, **kwargs):
        self.calls.append(("save_pretrained_merged", save_method))
        return self._result(save_method, Path(folder))

    def save_pretrained_gguf(self, folder, tokenizer, methods, **kwargs):
        self.calls.append(("save_pretrained_gguf", tuple(methods)))
        return [self._result(m, Path(folder) / f"x.{m.upper()}.gguf") for m in methods]


@pytest.mark.parametrize("name", FORMS)
def test_report_writes_the_form(name, tmp_path):
    model = _Recorder()
    rows = export_and_verify(model, None, tmp_path, forms=[name], gguf_methods=["q8_0"], verify=False)
    form = EXPORT_FORMS[name]
    assert [row["form"] for row in rows] == ([f"{name} q8_0"] if form.quantized else [name])
    assert model.calls[0][0] == form.writer


@pytest.mark.parametrize("name", TYPES)
def test_gguf_type_has_its_consumers(name):
    import gguf

    t = GGUF_TYPES[name]
    assert normalize_quantization_methods(name) == [name]
    for alias in t.aliases:
        assert normalize_quantization_methods(alias) == [name]
    assert name in GGUF_TOLERANCE
    assert (name in KQUANT_METHODS) == t.needs_llama_cpp and (name in GGUF_METHODS) != t.needs_llama_cpp
    if t.needs_llama_cpp:
        assert t.ggml_type is None and t.file_type is None
    else:  # notebookkit encodes it: the gguf package knows both names
        assert gguf.GGMLQuantizationType[t.ggml_type] is not None and gguf.LlamaFileType[t.file_type] is not None
    assert (name in GGUF_CHOICES) == t.in_panel
