"""Give a loaded model its export methods (``save_pretrained_merged``, ``save_pretrained_gguf``, ...).

The methods live in ``notebookkit.export``, a layer *above* this one, so this module does not
import it at import time: ``import notebookkit.models`` never loads the exporters, and nothing
depends on which package is imported first. The import happens inside the call, once per model
that ``from_pretrained`` / ``get_peft_model`` hand back.
"""

from __future__ import annotations

import torch.nn as nn


def attach_export_methods(model: nn.Module) -> nn.Module:
    """Bind the export methods onto ``model`` (this instance only); returns it."""
    from notebookkit.export.bind import bind_export_methods

    return bind_export_methods(model)
