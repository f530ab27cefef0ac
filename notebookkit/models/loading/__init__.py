"""The one load pipeline behind ``from_pretrained`` (text and vision share it).

* :mod:`.loader`: name resolution, weights, tokenizer, the patch step, adapters saved in a folder;
* :mod:`.arguments`: the checks of what a notebook passes, made before anything loads;
* :mod:`.offline`: one readable error for a name the Hub cannot serve;
* :mod:`.offload_embedding`: the input embedding table kept in host memory (``offload_embedding=True``);
* :mod:`.nf4_experts`, :mod:`.stream_nf4_experts`: a mixture of experts' stacked expert weights in NF4 under
  ``load_in_4bit``, each quantised as it is read.
"""
