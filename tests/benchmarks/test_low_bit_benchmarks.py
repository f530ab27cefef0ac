"""CPU tests of the sub-4-bit benchmark tools: ``low_bit_step.py`` end to end on a tiny ternary model, and
``registry_assets.r_character_vectors`` (the reader of the R database that holds the quality benchmark's
English text) on a database written here byte by byte."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib

BENCHMARKS = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks"))
sys.path.insert(0, BENCHMARKS)

from registry_assets import r_character_vectors  # noqa: E402


def _xdr_object(version: int, body: bytes) -> bytes:
    """One serialised R object: ``X\\n``, the format version, two R versions, (v3) the native encoding."""
    head = b"X\n" + struct.pack(">iii", version, 0x040300, 0x030500)
    if version == 3:
        head += struct.pack(">i", 5) + b"UTF-8"
    return head + body


def _strsxp(lines: list[str | None]) -> bytes:
    out = struct.pack(">ii", 16, len(lines))
    for line in lines:
        if line is None:
            out += struct.pack(">ii", 9, -1)
        else:
            data = line.encode("utf-8")
            out += struct.pack(">ii", 9 | 0x8000, len(data)) + data
    return out


def _block(obj: bytes) -> bytes:
    return struct.pack(">I", len(obj)) + zlib.compress(obj)


def test_r_character_vectors_reads_every_string_vector_and_skips_other_objects():
    integers = struct.pack(">ii", 13, 3) + struct.pack(">iii", 1, 2, 3)
    rdb = (_block(_xdr_object(3, _strsxp(["PERSUASION", "", "Chapter 1", None, "Sir Walter Elliot, of Kellynch Hall"])))
           + _block(_xdr_object(2, integers))
           + _block(_xdr_object(2, _strsxp(["EMMA", "Emma Woodhouse, handsome, clever, and rich — ✓"]))))
    assert r_character_vectors(rdb) == [
        ["PERSUASION", "", "Chapter 1", "", "Sir Walter Elliot, of Kellynch Hall"],
        ["EMMA", "Emma Woodhouse, handsome, clever, and rich — ✓"],
    ]


def test_low_bit_step_trains_a_tiny_ternary_model_and_reports_the_memory_models_prediction():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(BENCHMARKS), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "low_bit_step.py"), "--shape", "llama-tiny",
                          "--format", "ternary", "--seq", "64", "--batch", "2", "--steps", "4", "--rank", "8",
                          "--lr", "1e-2"], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    assert result["format"] == "ternary" and result["rank"] == 8 and result["trainable"] > 0
    assert result["loss_last"] < result["loss_first"], result["losses"]
    assert result["predicted_gib"] is not None and result["predicted_gib"] > 0
