"""`hidden_states_moving_in_each_layer(model, ids, mask)`: a padded forward with the layers in
the caller's layout, each attention moving the rows itself (the path `Transformer.forward`
replaced by moving real tokens to the front once), for tests to compare its bits with."""

import torch.nn.functional as F
from torch import Tensor

from reprorl.kernels.shared import Padding


def hidden_states_moving_in_each_layer(model, ids: Tensor, mask: Tensor) -> Tensor:
    t, kernels = model.model, model.kernels
    padding = Padding(mask)
    cos, sin = t._rope((mask.cumsum(-1) - 1).clamp(min=0), ids.shape[1] - 1)
    x = F.embedding(ids, t.embed_tokens.weight)
    for layer in t.layers:
        x = layer(x, cos, sin, padding, kernels)
    return t.norm(x, kernels)
