"""The chunk directory: source leases, the busiest holders spared, the rarest chunks first,
and plans that wait for something to plan."""

from __future__ import annotations

import asyncio

import pytest

from dask_pcm.scheduler import directory as chunk_directory
from dask_pcm.scheduler.directory import ChunkDirectory


def make(workers: str = "abcdef", whole: set[str] | None = None, max_uploads: int = 4):
    return ChunkDirectory(
        whole_copies=lambda digest: set(whole or ()),
        connected=lambda: set(workers),
        max_uploads=max_uploads,
    )


def test_the_source_is_leased_a_few_chunks_at_a_time_and_lost_holders_are_forgotten(monkeypatch):
    monkeypatch.setattr(chunk_directory, "SOURCE_LEASES", 2)
    monkeypatch.setattr(chunk_directory, "SOURCE_READS", 4)
    directory = make()
    plan, have = directory.plan, directory.have
    everything = [0, 1, 2, 3, 4, 5]
    for worker in "abc":  # three workers copy the template
        plan("d", worker, [])
    assert plan("d", "a", everything) == {"peers": {}, "source": [0, 1]}  # 2 per worker
    assert plan("d", "b", everything) == {"peers": {}, "source": [2, 3]}
    # 4 chunks of the template are being read: nobody reads another until one is in.
    assert plan("d", "c", everything) == {"peers": {}, "source": []}
    have("d", "a", [0])  # a's lease on 0 ends; 0 is now held by a
    assert plan("d", "c", everything) == {"peers": {0: ["a"]}, "source": [4]}
    have("d", "c", [], released=[0, 4])  # c gave up: its upload from a and its lease end
    have("d", "a", [], lost=[0])  # a could not serve 0 after all
    assert plan("d", "c", [0]) == {"peers": {}, "source": [0]}
    directory.remove_worker("b")  # b's leases on 2 and 3 lapse with it
    assert plan("x", "a", [9])["source"] == [9]  # another template: its own leases
    assert plan("d", "a", [2, 3]) == {"peers": {}, "source": [2]}  # a holds 1 lease
    have("d", "c", [5, 6])
    have("d", "c", [], lost=[5], bad=[5])  # c served 5 with the wrong bytes
    have("d", "a", [5])
    assert plan("d", "b", [5, 6]) == {"peers": {5: ["a"], 6: ["c"]}, "source": []}
    have("d", "a", [], lost=[5], bad=[5])
    have("d", "b", [], released=[5, 6])
    assert plan("d", "b", [5]) == {"peers": {}, "source": [5]}


def test_uploads_go_to_the_least_loaded_holder_and_never_beyond_max_uploads():
    directory = make("abcdefgh", whole={"a", "b"}, max_uploads=2)
    firsts = [directory.plan("d", w, [0], limit=1)["peers"][0][0] for w in "cdef"]
    assert sorted(firsts) == ["a", "a", "b", "b"]  # two each, not four from one
    # Both holders have 2 uploads planned: the next asker gets nothing, not a queue.
    assert directory.plan("d", "g", [0], limit=1) == {"peers": {}, "source": []}
    directory.have("d", "c", [0])  # c's upload is done: c holds 0, its holder has room
    assert directory.plan("d", "g", [0], limit=1)["peers"][0] == ["c", firsts[0]]
    full = ({"a", "b"} - {firsts[0]}).pop()
    assert full not in directory.plan("d", "h", [0], limit=1)["peers"][0]
    # A holder that leaves takes its planned uploads with it.
    directory.remove_worker(firsts[0])
    assert directory.load["d"][firsts[0]] == 0


def test_the_rarest_chunks_are_planned_first_and_at_most_limit():
    directory = make()
    for worker in "abc":
        directory.have("d", worker, [0])
    directory.have("d", "a", [1])
    directory.have("d", "b", [1])
    directory.have("d", "a", [2])
    plan = directory.plan("d", "e", [0, 1, 2, 3], limit=2)
    # Chunk 2 has one holder, 1 has two, 0 three; 3 nobody (the source, if room is left).
    assert list(plan["peers"]) == [2, 1] and plan["source"] == []
    plan = directory.plan("d", "f", [0, 3], limit=2)
    assert list(plan["peers"]) == [0] and plan["source"] == [3]


def test_a_waiting_plan_returns_as_soon_as_a_chunk_is_held():
    async def main():
        directory = make()
        directory.plan("d", "a", [0, 1])  # a reads 0 and 1 from the source
        directory.plan("d", "b", [2, 3])
        loop = asyncio.get_running_loop()
        start = loop.time()
        waiting = asyncio.ensure_future(directory.plan_waiting("d", "c", [0, 1], 1, wait=30))
        await asyncio.sleep(0)  # one turn of the loop: the plan runs up to its wait
        assert not waiting.done()  # every chunk c wants is being read by someone else
        directory.have("d", "a", [1])
        answer = await asyncio.wait_for(waiting, 5)
        assert answer == {"peers": {1: ["a"]}, "source": [], "together": True}
        assert loop.time() - start < 5
        # With nothing to plan, it gives up after ``wait``, with an empty plan.
        assert await directory.plan_waiting("d", "e", [0], 1, wait=0.1) == {
            "peers": {},
            "source": [],
            "together": True,  # a, b and c copy the template too
        }

    asyncio.run(main())


@pytest.mark.parametrize("reads", [1, 4])
def test_source_reads_per_template_are_bounded(monkeypatch, reads):
    monkeypatch.setattr(chunk_directory, "SOURCE_READS", reads)
    directory = make()
    leased = [i for w in "abcdef" for i in directory.plan("d", w, list(range(20)))["source"]]
    assert len(leased) == reads and len(set(leased)) == reads


def test_a_worker_alone_reads_the_source_as_fast_as_all_together(monkeypatch):
    # One lease each while others copy the template too (each chunk out of the source as
    # early as possible, for them to pass on); all of them for the only worker copying it,
    # so that the source is read while the worker writes what it read.
    monkeypatch.setattr(chunk_directory, "SOURCE_LEASES", 1)
    monkeypatch.setattr(chunk_directory, "SOURCE_READS", 2)
    assert make("a").plan("d", "a", [0, 1, 2]) == {"peers": {}, "source": [0, 1]}
    together = make("ab")
    together.plan("d", "b", [])  # b copies it too
    assert together.plan("d", "a", [0, 1, 2]) == {"peers": {}, "source": [0]}
    assert together.plan("d", "b", [0, 1, 2]) == {"peers": {}, "source": [1]}
    # b is connected but never asks (it waits for a copy on a's host): a is alone.
    host = make("ab")
    assert host.plan("d", "a", [0, 1, 2]) == {"peers": {}, "source": [0, 1]}


def test_a_holder_serving_one_peer_alone_gives_it_as_many_chunks_as_it_asks():
    directory = make("abcd", whole={"a"}, max_uploads=2)
    # One peer's window takes four chunks from the one holder: nobody else wants them.
    assert directory.plan("d", "b", [0, 1, 2, 3], limit=4)["peers"] == {i: ["a"] for i in range(4)}
    assert directory.load["d"]["a"] == 4
    # Shared between peers, the holder takes no more than max_uploads at once.
    assert directory.plan("d", "c", [0, 1], limit=2) == {"peers": {}, "source": []}
    directory.have("d", "b", [0, 1, 2])
    assert directory.load["d"]["a"] == 1  # b still has chunk 3 planned from a
    plan = directory.plan("d", "c", [0, 1, 4], limit=3)["peers"]
    # One more from a (up to max_uploads), the others from b, which holds 0 to 2.
    assert sorted(plan) == [0, 1, 4]
    assert (plan[4][0], plan[0][0], plan[1][0]) == ("a", "b", "b")
    assert directory.load["d"]["a"] == 2


def test_a_change_wakes_a_few_waiting_plans_not_all():
    """Waking every waiting plan on every change made the scheduler's time grow as N
    squared; the plans waiting longest are woken, the others at the next change."""

    async def main():
        directory = make("abcdefghijkl", max_uploads=1)
        for worker in "bcdefghijk":  # ten workers copy it: a reads the source
            directory.plan("d", worker, [])
        assert directory.plan("d", "a", [0])["source"] == [0]
        waiting = [
            asyncio.ensure_future(directory.plan_waiting("d", w, [0], 1, wait=30))
            for w in "bcdefghijk"
        ]
        await asyncio.sleep(0)
        plans = []
        plan = directory.plan
        directory.plan = lambda digest, worker, *args: (
            plans.append(worker) or plan(digest, worker, *args)
        )
        directory.have("d", "a", [0])  # one holder, one upload at a time: one can have it
        await asyncio.sleep(0.01)
        assert plans == list("bcde")[: chunk_directory.WOKEN_PER_CHANGE]  # longest waiting
        assert [t.result()["peers"] for t in waiting if t.done()] == [{0: ["a"]}]
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)

    asyncio.run(main())
