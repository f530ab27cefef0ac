"""Loaded models rebound, instance by instance, onto the fused kernels (and back).

* :mod:`.patcher`: walks a causal LM and patches its norms, MLPs, attention and LM head;
* ``patch_*``: one module kind each (:mod:`.patch_attention`, :mod:`.patch_mlp`, :mod:`.patch_norms`,
  :mod:`.patch_lm_head`, :mod:`.patch_lora_linear`);
* :mod:`.lora_fast_path`: which linears run on the fused LoRA kernels, and their projection views;
* :mod:`.forward_state`: the state of one forward of a patched model;
* :mod:`.checkpointing`: the activation plan (keep, recompute, offload) per decoder layer;
* :mod:`.master_weights`: fp32 master weights for the trainable parameters under fp16.
"""
