"""`padded_batch`: token ids, attention mask and positions of a padded batch, for the tests
that compare our models with transformers' on the same input; `padding_mask`: the mask alone."""

import torch


def padding_mask(lengths, width: int, side: str):
    """[B, width] long: each row's `lengths[b]` real tokens on the left or right side."""
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        if side == "left":
            mask[i, width - n :] = 1
        else:
            mask[i, :n] = 1
    return mask


def padded_batch(vocab: int, side: str = "left", seed: int = 0, lengths: tuple[int, ...] = (12, 8, 1)):
    """Sequences of `lengths` real tokens, padded to the longest; ids avoid the pad id 0;
    positions count real tokens."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), width), generator=g)
    mask = padding_mask(lengths, width, side)
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)
