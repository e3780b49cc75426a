"""`hidden_states_moving_in_each_layer(model, ids, mask)`: a padded forward with the layers in
the caller's layout, each attention moving the rows itself (the path `Transformer.forward`
replaced by moving real tokens to the front once), for tests to compare its bits with."""

from torch import Tensor

from reprorl.kernels.shared import Padding


def hidden_states_moving_in_each_layer(model, ids: Tensor, mask: Tensor) -> Tensor:
    t, kernels = model.model, model.kernels
    padding = Padding(mask)
    rope = t._rope((mask.cumsum(-1) - 1).clamp(min=0), ids.shape[1] - 1)
    x = t._embed(ids)
    for layer, (cos, sin) in zip(t.layers, rope):
        x = layer(x, cos, sin, padding, kernels)
    return t.norm(x, kernels)
