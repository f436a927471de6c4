"""The window of a template copy: grows while a chunk more raises the rate, not beyond."""

from __future__ import annotations

import pytest

from dask_pcm.templates.window import PROBE_AFTER, Window

CHUNK = 64 << 20


def feed(window: Window, rate_of, samples: int, start: float = 0.0) -> float:
    """``samples`` samples at the rate ``rate_of(size)`` (bytes per second)."""
    now = start
    window.started(now)
    for _ in range(samples):
        for _ in range(window.size):
            now += CHUNK / rate_of(window.size)
            window.received(CHUNK, now)
    return now


def test_on_a_link_with_room_the_window_grows_to_its_cap():
    # A long path: every chunk more in flight adds its share of the rate.
    window = Window(start=2, cap=6)
    feed(window, lambda size: size * 100e6, samples=20)
    assert window.size == window.peak == 6


def test_on_a_full_link_the_window_steps_back_and_only_probes():
    window = Window(start=2, cap=8)
    feed(window, lambda size: 100e6, samples=40)
    assert window.size in (2, 3) and window.peak == 3
    sizes = [size for size, _ in window.history]
    assert sizes.count(3) <= len(sizes) // PROBE_AFTER + 1  # probes, one sample each


def test_a_link_that_fills_up_keeps_the_window_where_it_stopped_paying():
    # The rate rises with the window up to 4 chunks, then stays: the window ends at 4 or
    # probes 5, never more.
    window = Window(start=2, cap=8)
    feed(window, lambda size: min(size, 4) * 100e6, samples=40)
    assert window.peak == 5 and window.size in (4, 5)


def test_a_rate_that_falls_at_one_size_shrinks_it_but_never_below_the_floor():
    window = Window(start=2, cap=8)
    now = feed(window, lambda size: size * 100e6, samples=12)
    assert window.size == 8
    rate = [800e6]

    def falling(size: int) -> float:
        rate[0] *= 0.8
        return rate[0]

    feed(window, falling, samples=30, start=now)
    assert window.size == 2


def test_samples_with_free_slots_or_other_copies_say_nothing():
    window = Window(start=2, cap=8)
    now = 0.0
    window.started(now)
    for _ in range(20):  # the copy waits for peers between chunks: no growth from that
        now += 1.0
        window.received(CHUNK, now)
        window.starved(now)
    assert window.size == 2
    feed(window, lambda size: size * 100e6, samples=6, start=now)
    assert window.size > 3
    window.shared(now)  # a broadcast: back to the floor
    assert window.size == 2


@pytest.mark.parametrize(("start", "cap"), [(0, 4), (2, 0)])
def test_a_window_needs_room_for_a_chunk(start, cap):
    with pytest.raises(ValueError, match="at least 1"):
        Window(start, cap)


def test_the_start_is_lowered_to_the_cap():
    assert Window(start=4, cap=2).size == 2
