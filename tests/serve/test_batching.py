import asyncio

import pytest

from raypipe.serve.batching import TokenBudgetBatcher


def test_concurrent_requests_share_engine_calls_within_the_budget():
    calls: list[int] = []

    def run(seqs):
        calls.append(sum(map(len, seqs)))
        return [sum(s) for s in seqs]

    async def main():
        batcher = TokenBudgetBatcher(run, max_tokens=10)
        requests = [[[i] * 3] for i in range(8)] + [[[1, 2], [3]]]
        results = await asyncio.gather(*(batcher.submit(r) for r in requests))
        return batcher, requests, results

    batcher, requests, results = asyncio.run(main())
    assert results == [[sum(s) for s in r] for r in requests]
    assert batcher.engine_calls == len(calls) < len(requests)
    assert all(c <= 10 for c in calls)


def test_an_engine_error_reaches_every_waiter_and_the_batcher_goes_on():
    def run(seqs):
        if any(s == [0] for s in seqs):
            raise RuntimeError("engine refused")
        return seqs

    async def main():
        batcher = TokenBudgetBatcher(run, max_tokens=100)
        with pytest.raises(RuntimeError, match="engine refused"):
            await batcher.submit([[0]])
        return await batcher.submit([[5]])

    assert asyncio.run(main()) == [[5]]
