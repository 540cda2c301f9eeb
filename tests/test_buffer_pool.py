"""The buffer pool lends large buffers again once their borrower let them go."""

from __future__ import annotations

import gc

import torch

from beamplugin.runtime.buffer_pool import BufferPool

LIKE = torch.empty(0)


def test_a_dropped_lease_gives_its_buffers_to_the_next_one():
    pool = BufferPool()
    lease = pool.lease()
    first = lease.take((2, 8, 16), LIKE, grows=(1, 2))
    assert torch.equal(first, torch.zeros(2, 8, 16))  # new: zeros
    first.fill_(3.0)
    pointer = first.data_ptr()
    del lease, first
    gc.collect()
    again = pool.lease().take((2, 5, 16), LIKE, grows=(1, 2))
    assert again.data_ptr() == pointer and again.shape == (2, 8, 16)
    assert bool(again.eq(3.0).all())  # the last borrower's values, not cleared


def test_a_held_buffer_is_never_lent_twice_and_a_given_back_one_is():
    pool = BufferPool()
    lease = pool.lease()
    held = lease.take((4, 4), LIKE, grows=(0,))
    borrower = pool.lease()
    assert borrower.take((4, 4), LIKE, grows=(0,)).data_ptr() != held.data_ptr()
    lease.give_back(held)
    assert borrower.take((3, 4), LIKE, grows=(0,)).data_ptr() == held.data_ptr()


def test_only_buffers_large_enough_along_the_growing_dimensions_are_lent():
    pool = BufferPool()
    lease = pool.lease()
    small = lease.take((2, 4, 16), LIKE, grows=(1, 2))
    lease.give_back(small)
    wider = pool.lease().take((2, 4, 32), LIKE, grows=(1, 2))
    assert wider.data_ptr() != small.data_ptr() and wider.shape == (2, 4, 32)
    fixed = pool.lease().take((3, 4, 16), LIKE, grows=(1, 2))  # dim 0 must match exactly
    assert fixed.data_ptr() != small.data_ptr()
    assert pool.lease().take((2, 4, 16), LIKE, grows=(1, 2)).data_ptr() == small.data_ptr()
    assert pool.lease().take((2, 4, 16), LIKE.double(), grows=(1, 2)).dtype == torch.float64


def test_the_pool_keeps_the_largest_free_buffers():
    pool = BufferPool(keep=2)
    lease = pool.lease()
    buffers = [lease.take((rows, 8), LIKE, grows=(0,)) for rows in (4, 64, 2, 32)]
    for buffer in buffers:
        lease.give_back(buffer)
    borrower = pool.lease()
    kept = {borrower.take((1, 8), LIKE, grows=(0,)).size(0) for _ in range(2)}
    assert kept == {32, 64}
    assert borrower.take((1, 8), LIKE, grows=(0,)).size(0) == 1  # nothing left: new
