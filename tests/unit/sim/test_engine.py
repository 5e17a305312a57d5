from __future__ import annotations

import asyncio

import pytest

from hivenet_router.sim.engine import Engine, PrefixCache, Timing, block_hashes
from hivenet_router.sim.faults import Faults

TIMING = Timing(ttft_base=0.02, prefill_per_token=0.001, itl=0.01, batch_slowdown=0.1)


def engine(max_num_seqs: int = 2, kv: int = 1000) -> Engine:
    return Engine(
        max_num_seqs=max_num_seqs,
        kv_cache_tokens=kv,
        block_size=4,
        timing=TIMING,
        zero_latency=False,
    )


def test_shared_prefixes_share_blocks() -> None:
    a = block_hashes(b"x" * 64 + b"tail-one" * 4, 4)
    b = block_hashes(b"x" * 64 + b"tail-two" * 4, 4)
    assert a[:4] == b[:4] and a[4:] != b[4:]


def test_prefix_cache_lru() -> None:
    cache = PrefixCache(3)
    assert cache.match([1, 2, 3]) == 0
    assert cache.match([1, 2, 3]) == 3
    assert cache.match([9]) == 0  # evicts 1, the least recently used
    assert cache.match([1, 2]) == 0


async def test_prefill_gets_cheaper_with_a_warm_prefix() -> None:
    eng = engine()
    prompt = b"p" * 400
    cold = await eng.admit(prompt, 10)
    eng.release(cold, "stop", 10)
    warm = await eng.admit(prompt, 10)
    assert eng.prefill_delay(warm) < eng.prefill_delay(cold)
    eng.release(warm, "stop", 10)
    assert eng.stats.prefix_hits > 0


async def test_batch_limit_queues_and_decode_slows() -> None:
    eng = engine(max_num_seqs=1)
    first = await eng.admit(b"a", 5)
    alone = eng.token_delay()
    waiter = asyncio.create_task(eng.admit(b"b", 5))
    await asyncio.sleep(0)
    assert eng.waiting == 1 and not waiter.done()
    eng.release(first, "stop", 5)
    second = await waiter
    assert eng.waiting == 0 and eng.running == 1
    eng.release(second, "stop", 5)
    big = engine(max_num_seqs=4)
    seqs = [await big.admit(b"x", 1) for _ in range(4)]
    assert big.token_delay() > alone
    for seq in seqs:
        big.release(seq, "length", 1)
    assert big.kv_used == 0


async def test_kv_budget_limits_admission() -> None:
    eng = engine(max_num_seqs=10, kv=100)
    first = await eng.admit(b"a" * 200, 40)  # 50 prompt tokens + 40
    waiter = asyncio.create_task(eng.admit(b"b" * 200, 40))
    await asyncio.sleep(0)
    assert not waiter.done() and eng.kv_usage > 0.8
    eng.release(first, "stop", 40)
    eng.release(await waiter, "stop", 40)


async def test_cancelled_waiter_is_dropped() -> None:
    eng = engine(max_num_seqs=1)
    first = await eng.admit(b"a", 1)
    waiter = asyncio.create_task(eng.admit(b"b", 1))
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert eng.waiting == 0
    eng.release(first, "stop", 1)
    assert eng.running == 0


def test_fault_updates_are_validated() -> None:
    faults = Faults()
    faults.update({"error_rate": 0.5, "latency": 0.1})
    assert faults.error_rate == 0.5
    for bad in ({"nope": 1}, {"error_rate": 2}, {"latency": -1}, {"hang_rate": "x"}):
        try:
            faults.update(bad)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad}")


async def test_slowdown_scales_every_delay_from_its_next_use() -> None:
    faults = Faults()
    eng = Engine(
        max_num_seqs=2,
        kv_cache_tokens=1000,
        block_size=4,
        timing=TIMING,
        zero_latency=False,
        faults=faults,
    )
    seq = await eng.admit(b"q" * 400, 10)
    prefill, token = eng.prefill_delay(seq), eng.token_delay()
    assert prefill == 0.02 + 100 * 0.001  # the fixed part and every uncached token
    faults.update({"slowdown": 3})
    assert eng.prefill_delay(seq) == 3 * prefill
    assert eng.token_delay() == 3 * token
    faults.update({"slowdown": 1})
    assert (eng.prefill_delay(seq), eng.token_delay()) == (prefill, token)
    eng.release(seq, "stop", 10)


def test_slowdown_is_a_factor_of_at_least_one() -> None:
    faults = Faults()
    assert faults.slowdown == 1.0
    for bad in (0.5, 0, -1, "x", True, None):
        try:
            faults.update({"slowdown": bad})
        except ValueError as exc:
            assert "slowdown" in str(exc)
            continue
        raise AssertionError(f"accepted slowdown {bad!r}")
    faults.update({"slowdown": 2.5})
    assert faults.slowdown == 2.5


def test_a_refused_update_changes_nothing() -> None:
    faults = Faults()
    with pytest.raises(ValueError, match="error_rate"):
        faults.update({"slowdown": 3, "error_rate": 2})
    assert faults == Faults()
