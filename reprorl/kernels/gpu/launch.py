"""Compiler options that change a kernel's bits, pinned at every launch here (`PINNED`)
rather than left to Triton's defaults or to the environment.

`enable_fp_fusion` says whether `a * b + c` compiles to one fused multiply-add (one
rounding) or to a multiply and an add (two). Triton fuses by default today, but 3.9 warns
that 3.10 will not, and `TRITON_DEFAULT_FP_FUSION` changes the default as well. A kernel's
bits must not change with Triton's version or an environment variable, so every launch
passes it: on, the arithmetic every figure and test so far was made with. (Triton's
`TRITON_FORCE_DISABLE_FP_FUSION` overrides even this; the determinism report flags it.)
"""

PINNED = {"enable_fp_fusion": True}
