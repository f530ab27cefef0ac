"""Vision-language models: the vision variant of the one load pipeline and its patches.

* :mod:`.loader`: ``FastVisionModel.from_pretrained`` (:mod:`.processor` loads the processor);
* :mod:`.targets`: which linears get LoRA adapters, from the four ``finetune_*`` switches;
* :mod:`.patcher`: the wrapper's decoder, tower and heads onto the fused kernels;
* :mod:`.tower_attention`, :mod:`.segment_attention`: Qwen2.5-VL's tower attention, one SDPA call per segment length;
* :mod:`.lm_head`: the wrapper's LM head on fused linear cross-entropy;
* :mod:`.decode`: image prompts on the fast decode path.
"""
