"""Whether Triton runs under its interpreter (TRITON_INTERPRET=1: CPU tensors, numpy).

The interpreter (triton 3.9) computes `tl.dot` of bfloat16 operands on their raw bits, so
under it the kernels widen bf16 operands to float32 before a dot (`DOT_UPCAST`). That is the
same arithmetic: a bf16 x bf16 product is exact in float32, and the GPU's MMA sums such
products in float32 too.
"""

import os

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
