"""Running requests against a built-in engine from a test: the CPU and GPU engine tests share it."""

import asyncio

from reprorl.rollout.engine import GenerateOutput


def generate_all(engine, requests, delays=None) -> list[GenerateOutput]:
    """Run requests concurrently (optionally staggered by `delays` seconds); outputs in request order."""

    async def one(r, delay):
        if delay:
            await asyncio.sleep(delay)
        return await engine.generate(**r)

    async def main():
        return await asyncio.gather(*[one(r, d) for r, d in zip(requests, delays or [0] * len(requests))])

    return asyncio.run(main())
