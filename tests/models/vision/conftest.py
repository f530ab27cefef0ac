"""Shared pieces of the vision-language tests: the tiny VLMs of the family record and caption rows."""

from __future__ import annotations

import pytest

from notebookkit.families import vision_families

#: family name -> its vision row, for every family with a vision-language wrapper
VISION = {f.name: f.vision for f in vision_families().values()}


@pytest.fixture(scope="session")
def vlm_folder():
    """``vlm_folder(family)``: the folder of the family's tiny VLM (the shared cache, built on first use)."""
    from notebookkit.embedded.tiny import ensure_tiny_model

    return lambda family: str(ensure_tiny_model(VISION[family].tiny_name))


@pytest.fixture(scope="session")
def caption_rows():
    """``caption_rows(n, split)``: the first ``n`` rows of the bundled captions set, as dicts."""
    from notebookkit.embedded.bundled import load_bundled

    cache = {}

    def rows(n: int, split: str = "train") -> list[dict]:
        if split not in cache:
            cache[split] = load_bundled("captions", split=split)
        ds = cache[split]
        return [ds[i] for i in range(n)]

    return rows
