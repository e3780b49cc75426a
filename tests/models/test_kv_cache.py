"""The KV cache: prefix copies move exactly the tokens asked for."""

import torch

from reprorl.models.kv_cache import KVCache


def test_copy_prefixes_copy_each_source_slots_first_tokens_and_nothing_else():
    cache = KVCache(num_layers=2, num_kv_heads=2, head_dim=4, capacity=8, num_slots=7)
    g = torch.Generator().manual_seed(0)
    for buf in cache.keys + cache.values:
        buf.copy_(torch.randn(buf.shape, generator=g))
    before = [buf.clone() for buf in cache.keys + cache.values]
    cache.copy_prefixes([(1, [0, 3], 5), (4, [6], 2)])  # two prompts of a step, of different lengths
    for buf, old in zip(cache.keys + cache.values, before):
        expected = old.clone()
        expected[0, :, :5] = old[1, :, :5]
        expected[3, :, :5] = old[1, :, :5]
        expected[6, :, :2] = old[4, :, :2]
        assert torch.equal(buf, expected)
    assert cache.lengths == [5, 0, 0, 5, 0, 0, 2]
