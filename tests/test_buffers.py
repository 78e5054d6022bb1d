"""core.buffers: the one lease-based buffer pool (loader batches, server responses)."""

from __future__ import annotations

import gc
import threading

import numpy as np

from featurestore.core.buffers import PAGE, BufferPool, aligned_empty


def test_lease_returns_buffer_only_when_last_view_dies() -> None:
    pool = BufferPool(keep=2)
    a = pool.array((4, 1000), np.float16)
    assert a.shape == (4, 1000) and a.dtype == np.float16 and a.flags.c_contiguous
    assert a.ctypes.data % PAGE == 0
    address = a.ctypes.data
    view = a[1:3]  # a view keeps the lease alive
    del a
    gc.collect()
    assert pool.free_bytes == 0
    b = pool.array((4, 1000), np.float16)
    assert b.ctypes.data != address  # the held buffer was not handed out again
    del view
    gc.collect()
    assert pool.free_bytes >= 8000
    c = pool.array((4, 1000), np.float16)
    assert c.ctypes.data == address  # reused once every view was gone
    del b, c


def test_pool_bounds_idle_buffers_by_count_and_bytes() -> None:
    pool = BufferPool(keep=2, max_free_bytes=3 * PAGE)
    held = [pool.lease(PAGE) for _ in range(4)]
    del held
    gc.collect()
    assert pool.free_bytes == 2 * PAGE  # keep=2
    pool.clear()
    big = [pool.lease(2 * PAGE) for _ in range(2)]
    del big
    gc.collect()
    assert pool.free_bytes == 2 * PAGE  # the second would exceed max_free_bytes


def test_small_request_does_not_take_a_large_buffer() -> None:
    pool = BufferPool(keep=2)
    big = pool.lease(64 * PAGE)
    address = big.ctypes.data
    del big
    gc.collect()
    small = pool.lease(PAGE)
    assert small.ctypes.data != address and pool.free_bytes == 64 * PAGE


def test_min_pooled_uses_plain_aligned_memory() -> None:
    pool = BufferPool(keep=2, min_pooled=1 << 20)
    a = pool.lease(100)
    assert a.size == 100 and a.ctypes.data % PAGE == 0
    del a
    gc.collect()
    assert pool.free_bytes == 0


def test_aligned_empty_shape_dtype() -> None:
    out = aligned_empty((3, 5), np.uint16)
    assert out.shape == (3, 5) and out.ctypes.data % PAGE == 0


def test_grow_pool_reuses_larger_buffers_and_keeps_the_largest() -> None:
    pool = BufferPool(keep=2, grow=True)
    big = pool.lease(10 * PAGE)
    base = big.__array_interface__["data"][0]
    del big
    gc.collect()
    small = pool.lease(PAGE)  # a grow pool hands out any idle buffer that holds the request
    assert small.nbytes == PAGE and small.__array_interface__["data"][0] == base
    del small
    gc.collect()
    # A full pool drops its smallest idle buffer for a larger returning one.
    leases = [pool.lease(n * PAGE) for n in (2, 3, 40)]
    del leases
    gc.collect()
    assert len(pool._free) == 2 and min(b.size for b in pool._free) >= 10 * PAGE
    assert max(b.size for b in pool._free) >= 40 * PAGE  # rounded up a quarter octave at most
    assert max(b.size for b in pool._free) <= 50 * PAGE


def test_a_lease_dropped_under_the_pools_own_lock_is_filed_later_not_deadlocked() -> None:
    # The garbage collector may run a lease's __del__ on a thread inside lease(), which holds the
    # pool's lock: giving the buffer back must not wait for that lock.
    pool = BufferPool(keep=2)
    held = [pool.array((4, 1000), np.float16)]
    address = held[0].ctypes.data

    def drop_while_holding_the_lock() -> None:
        with pool._lock:
            held.clear()

    thread = threading.Thread(target=drop_while_holding_the_lock, daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "giving a buffer back waited for a lock its own thread held"
    assert pool.free_bytes == 0  # not filed yet: it waits for the next lease
    again = pool.array((4, 1000), np.float16)
    assert again.ctypes.data == address
