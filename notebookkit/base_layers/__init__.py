"""The frozen base layers under the LoRA adapters, and the two tools they are built with.

* :mod:`.linear4bit`: bitsandbytes' NF4 ``Linear4bit`` layers, decoded by notebookkit on the CPU, and
  PEFT's merge into them checked first;
* :mod:`.low_bit_linear`: notebookkit's frozen 2-bit and ternary linears (``Q2Linear``, ``TernaryLinear``);
* :mod:`.rebinding`: the reversible rebinding of a module instance's ``forward`` that every patch uses;
* :mod:`.kernel_ops`: late-bound lookup of a kernel in :mod:`notebookkit.kernels`.

Both the model layer (:mod:`notebookkit.models`) and the exporters (:mod:`notebookkit.export`) read
these layers, so they sit below both.
"""
