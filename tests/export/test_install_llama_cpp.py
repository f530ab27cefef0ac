"""The export notebook's llama.cpp step: ``install_llama_cpp`` installs llama-cpp-python only when it is missing, and
stops with pip's error and what to do when pip cannot install it (a Colab without a compiler, no network)."""

from __future__ import annotations

import importlib.util
import subprocess

import pytest

from notebookkit.export import ExportError, install_llama_cpp
from notebookkit.export import kquants


def _fake(monkeypatch, present_after: bool, returncode: int):
    calls = []
    state = {"installed": False}
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == "llama_cpp":
            return object() if state["installed"] else None
        return real(name, *args, **kwargs)

    def run(cmd, **kwargs):
        calls.append(cmd)
        state["installed"] = present_after
        return subprocess.CompletedProcess(cmd, returncode, "", "ERROR: Failed building wheel for llama-cpp-python")

    monkeypatch.setattr(kquants.importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(kquants.subprocess, "run", run)
    return calls


def test_installs_when_missing(monkeypatch):
    calls = _fake(monkeypatch, present_after=True, returncode=0)
    assert install_llama_cpp() is True
    assert calls and calls[0][1:4] == ["-m", "pip", "install"] and calls[0][-1] == "llama-cpp-python"


def test_does_nothing_when_present(monkeypatch):
    calls = []
    monkeypatch.setattr(kquants.importlib.util, "find_spec", lambda name, *a, **k: object())
    monkeypatch.setattr(kquants.subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    assert install_llama_cpp() is False and calls == []


@pytest.mark.parametrize("returncode,present_after", [(1, False), (0, False)])
def test_a_failed_install_stops_with_what_to_do(monkeypatch, returncode, present_after):
    _fake(monkeypatch, present_after=present_after, returncode=returncode)
    with pytest.raises(ExportError) as info:
        install_llama_cpp()
    message = str(info.value)
    assert "could not be installed" in message and "What to do" in message and "verify=False" in message
    assert "Failed building wheel" in message  # pip's own error reaches the user
