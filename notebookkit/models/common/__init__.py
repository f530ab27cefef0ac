"""What every other part of :mod:`notebookkit.models` reads about a loaded model and the machine.

* :mod:`.banner`: the load report (versions, device, dtype, one line per fast-path feature);
* :mod:`.precision`: native bf16 support, and the dtype a family may compute in;
* :mod:`.architectures`: a loaded model's row of the family record (activation, soft-caps);
* :mod:`.decoder_layers`: where a causal LM keeps its decoder layers.
"""
