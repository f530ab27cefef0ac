"""SASS per weight byte of nf4_matvec's row kernel with x in bf16 (the AOT spec) against x in fp32 (X_KIND 0)."""
import sys
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import ptx_census as pc
import notebookkit.kernels.nf4_matvec as m
for i, (k, sig, cx, opt) in enumerate(m.AOT_SPECS):
    if k is m._nf4_matvec_row_kernel and not cx.get("ROWS_IN_THREAD"):
        print(i, sig["y_ptr"], "nested" if cx["NESTED"] else "plain", "lora" if cx["HAS_LORA"] else "", cx["BLOCK_N"], cx["STEP_BLOCKS"], opt.get("num_warps"))
idx = int(sys.argv[1])
k, sig, cx, opt = m.AOT_SPECS[idx]
for name, xk, words in (("as spec", cx["X_KIND"], sig["x_words_ptr"]), ("x fp32", 0, "*i64")):
    spec = (k, {**sig, "x_words_ptr": words, **({"bias_ptr": "*fp32", "u_ptr": "*fp32", "lora_b_ptr": "*fp32", "y_ptr": "*fp32"} if xk == 0 else {})}, {**cx, "X_KIND": xk}, opt)
    m.AOT_SPECS.append(spec)
    asm, c, o = pc.compile_spec("nf4_matvec", len(m.AOT_SPECS) - 1, 90, {})
    counts = pc.sass_opcodes(pc.sass_hot_loop(pc.disassemble(asm["cubin"])))
    per = pc.nf4_matvec_bytes_per_thread(c, o)
    print(name, sum(counts.values()), "SASS in loop;", f"{sum(counts.values()) / per:.2f} a byte;", counts.most_common(12))
