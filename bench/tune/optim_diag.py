"""Where a GPU's AdamW parts from the host's (reprorl/kernels/optim_math.py), part by part:
the step's parameter and moments against float64 arithmetic rounded after every operation
(the host kernel's bits), the norm's chunk sums, and a plain division and square root.

    python3 bench/tune/optim_diag.py      # on the GPU machine, from the project's root
"""
import torch, sys
sys.path.insert(0, "tests/kernels")
from test_optim_math import _state, SCALARS, _reference
from reprorl.kernels.optim_math import adamw_step_, adamw_torch, chunk_sums_of_squares
host = _state(1_000_003, seed=4); ref = _reference(*host, SCALARS)
gpu = [t.cuda() for t in host]
adamw_torch(*gpu, SCALARS)
for name, a, b in zip("pmv", ref, [gpu[0], gpu[2], gpu[3]]):
    d = (a != b.cpu()).sum().item(); print("gpu vs float64-rounded ref", name, d)
x = _state(4096 * 301, seed=5)[0]
print("chunk sums differ", (chunk_sums_of_squares(x, 4096) != chunk_sums_of_squares(x.cuda(), 4096).cpu()).sum().item())
a = torch.rand(100000) + 0.5; b = torch.rand(100000) + 0.5
print("div t/t", (a / b != (a.cuda() / b.cuda()).cpu()).sum().item(), "sqrt", (torch.from_numpy(a.double().numpy()**0.5).float() != torch.sqrt(a.cuda()).cpu()).sum().item())
