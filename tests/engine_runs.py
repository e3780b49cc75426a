"""Requests against a built-in engine from a test: the CPU and GPU engine tests share them."""

import asyncio

import torch

from reprorl.rollout.request import GenerateOutput, SamplingParams

EOS = 2  # the tiny models' end-of-sequence id


def req(rid, prompt, seed=0, priority=0, **params) -> dict:
    """One request's arguments to `Engine.generate`; `params` are its `SamplingParams`."""
    return {
        "request_id": rid,
        "prompt_ids": prompt,
        "sampling_params": SamplingParams(**params),
        "seed": seed,
        "priority": priority,
    }


def generate_all(engine, requests, delays=None) -> list[GenerateOutput]:
    """Run requests concurrently (optionally staggered by `delays` seconds); outputs in request order."""

    async def one(r, delay):
        if delay:
            await asyncio.sleep(delay)
        return await engine.generate(**r)

    async def main():
        return await asyncio.gather(*[one(r, d) for r, d in zip(requests, delays or [0] * len(requests))])

    return asyncio.run(main())


def key(out: GenerateOutput):
    """What must be bitwise equal between two runs of one request."""
    return out.token_ids, torch.tensor(out.log_probs, dtype=torch.float32), out.finish_reason


def assert_same(a: GenerateOutput, b: GenerateOutput):
    ta, la, fa = key(a)
    tb, lb, fb = key(b)
    assert ta == tb and fa == fb
    assert torch.equal(la, lb)
