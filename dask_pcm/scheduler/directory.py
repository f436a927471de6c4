"""The chunk directory: who holds which chunk of a template being copied, who reads which
chunk from the source, and which uploads are planned from whom.

Workers copying a template ask it for a plan (:meth:`ChunkDirectory.plan_waiting`) whenever
they can fetch another chunk, and report what they hold (:meth:`ChunkDirectory.have`); see
:mod:`dask_pcm.templates.fetch`. The plan spreads the work the way a pipelined broadcast
does: the source is read a few chunks at a time (a *lease* per chunk), so whole chunks come
out of it early, one after another; each chunk someone holds is planned from its least busy
holder, never one already serving ``pcm.template.max-uploads`` (but a holder serving one
peer alone gives it what its window asks for), rarest chunks first, so every new holder
starts passing its chunks on at once. A worker that served a chunk with the wrong bytes is
not offered for that chunk again. ``benchmarks/scale_out.py --simulate`` shows what this
gives at up to 1,024 workers.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Collection
from collections.abc import Set as AbstractSet
from typing import Any

from dask_pcm import config

logger = logging.getLogger(__name__)

# Chunks one worker may be reading from a template's source at once (all SOURCE_READS when
# it is the only worker copying the template: a reader alone then keeps the source busy
# while it writes what it read; workers that wait for another's copy on their host, or
# hold the template, do not count), chunks all workers together may be reading from it at
# once, and how long such a lease lasts before another worker may take the chunk. Few
# readers at a time make the source deliver whole chunks early, one after another, for
# peers to pass on while it reads the next; many at once would share its bandwidth and
# deliver them all at the end (`benchmarks/scale_out.py --simulate` compares settings).
SOURCE_LEASES = 1
SOURCE_READS = 2
LEASE_SECONDS = 120.0
# Peers offered per chunk: the least loaded first, the others in case it fails.
PEERS_OFFERED = 3
# Holders of a chunk weighed against each other for one plan, at most (drawn at random).
HOLDERS_WEIGHED = 16
# Waiting plans woken by one change (a chunk held, an upload or a lease done).
WOKEN_PER_CHANGE = 4

_NOBODY: frozenset[str] = frozenset()
_NO_HOLDERS: dict[int, set[str]] = {}


class ChunkDirectory:
    """Chunk holders, source leases, uploads planned and bad holders, per template digest.

    Parameters
    ----------
    whole_copies
        ``whole_copies(digest)``: the connected workers holding a complete copy.
    connected
        The connected workers' addresses (reports from others are ignored).
    max_uploads
        Uploads planned from one holder at once (``pcm.template.max-uploads``): a chunk whose
        holders are all that busy waits for the next plan (a holder serving one peer alone
        gives it as many as it asks for).
    """

    def __init__(
        self,
        whole_copies: Callable[[str], AbstractSet[str]],
        connected: Callable[[], Collection[str]],
        max_uploads: int | None = None,
    ) -> None:
        self.whole_copies = whole_copies
        self.connected = connected
        self.max_uploads = max_uploads or int(config.get("template.max-uploads"))
        self.holders: dict[str, dict[int, set[str]]] = {}
        # The same holders in the order they came (with some that left: a sample is
        # checked against the set), to draw a few from without listing them all.
        self.arrived: dict[str, dict[int, list[str]]] = {}
        self.leases: dict[str, dict[int, tuple[str, float]]] = {}
        # Workers that served a chunk failing verification: not offered for it again.
        self.bad_holders: dict[str, dict[int, set[str]]] = {}
        # Uploads planned and not yet reported done: worker -> {index: holder}; per holder,
        # the peers it has uploads planned to (its load is their number) and how many each.
        self.planned: dict[str, dict[str, dict[int, str]]] = {}
        self.load: dict[str, Counter[str]] = {}
        self.busy: dict[str, set[str]] = {}  # holders with max_uploads planned
        self.uploading: dict[str, dict[str, Counter[str]]] = {}
        # Workers asking for plans of a template, and when they last did (a worker that has
        # not asked for LEASE_SECONDS, or holds it whole, copies it no longer).
        self.copying: dict[str, dict[str, float]] = {}
        # Set (and replaced) whenever something changes that a waiting plan may use.
        self._whole: AbstractSet[str] = set()  # the whole copies the last plan saw
        # Plans waiting for a change, per digest, the longest waiting first.
        self._waiting: dict[str, collections.deque[asyncio.Future[None]]] = {}

    async def plan_waiting(
        self,
        digest: str,
        worker: str,
        missing: list[int],
        limit: int | None = None,
        wait: float = 0.0,
    ) -> dict[str, Any]:
        """RPC handler: :meth:`plan`; when it has nothing for ``worker``, wait up to ``wait``
        seconds for a change (a chunk held, an upload or a lease done, a worker gone) that
        may give it something, and plan again.

        Workers that ask this way hear of a chunk they can have at once, instead of asking
        again and again (each ask costs the scheduler a plan) or pausing longer between
        asks (which delays the copy). The answer also says whether other workers copy the
        template too (``"together"``).
        """
        answer = self.plan(digest, worker, missing, limit)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while not (answer["peers"] or answer["source"]):
            left = deadline - loop.time()
            if left <= 0:
                break
            changed = loop.create_future()
            self._waiting.setdefault(digest, collections.deque()).append(changed)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed, left)
            answer = self.plan(digest, worker, missing, limit)
        # Copies together keep few chunks queued on the links they share, so that each
        # chunk is passed on soon; a copy alone sizes its window to its link.
        # (The whole copies as the plan just now saw them: asking again costs O(N).)
        answer["together"] = self.others_copying(digest, worker, self._whole)
        return answer

    def _notify(self, digest: str | None = None) -> None:
        """Wake the :data:`WOKEN_PER_CHANGE` plans waiting longest on ``digest`` (None:
        every plan, on every template: a worker left).

        A change (a chunk held, an upload done) gives one or two workers something to
        fetch; waking every waiting plan for it would have each plan again (N plans per
        change at N workers, most of them for nothing), and the scheduler's time would
        grow as N squared. The others wait for the next change, which comes soon where
        many copy, or their ``wait``."""
        for key in list(self._waiting) if digest is None else [digest]:
            waiting = self._waiting.get(key)
            woken = 0
            while waiting and (digest is None or woken < WOKEN_PER_CHANGE):
                future = waiting.popleft()
                if not future.done():
                    future.set_result(None)
                    woken += 1
            if not waiting:
                self._waiting.pop(key, None)

    def plan(
        self, digest: str, worker: str, missing: list[int], limit: int | None = None
    ) -> dict[str, Any]:
        """RPC handler: where ``worker`` should get (at most ``limit`` of) its ``missing``
        chunks now.

        Returns ``{"peers": {index: [workers]}, "source": [indexes]}``. Chunks someone holds
        (whole copies and partial ones) come first, the rarest first, each from the least
        loaded of its holders (then up to two others, in case it fails); a holder with
        ``max_uploads`` uploads planned is not offered until one is done, unless they all go
        to the asker.
        Chunks nobody holds or reads get a source lease: at most :data:`SOURCE_LEASES` per
        worker (all of :data:`SOURCE_READS` when no other worker is copying the template)
        and :data:`SOURCE_READS` per template at once. A lease lapses after
        :data:`LEASE_SECONDS` or when its worker leaves.
        """
        now = time.time()
        copying = self.copying.setdefault(digest, {})
        copying[worker] = now
        limit = len(missing) if limit is None else limit
        whole = self._whole = self.whole_copies(digest)
        holders = self.holders.setdefault(digest, {})
        bad = self.bad_holders.get(digest, _NO_HOLDERS)
        leases = self.leases.setdefault(digest, {})
        if leases:
            for index in [i for i, (_, until) in leases.items() if until < now]:
                del leases[index]
        mine_planned = self.planned.setdefault(digest, {}).setdefault(worker, {})
        if mine_planned:  # asked again: what was planned for those chunks is over
            wanted = set(missing)
            for index in [i for i in mine_planned if i in wanted]:
                self._done(digest, worker, index)
        load = self.load.get(digest)
        if load is None:
            load = self.load[digest] = Counter()
        uploading = self.uploading.setdefault(digest, {})
        busy = self.busy.setdefault(digest, set())
        # Rarest first, ties in the order of ``missing`` turned at a random place: askers
        # that miss the same chunks start at different ones (cheaper than a shuffle, per
        # plan). Holder counts before bad ones and the asker are taken out: a guide.
        turn = int(random.random() * len(missing))
        held = holders.get
        order = sorted(missing[turn:] + missing[:turn], key=lambda i: len(held(i, ())))
        # Chunks nobody holds come first; with a whole copy somewhere every chunk has one.
        first = 0
        if not whole:
            while first < len(order) and not held(order[first]):
                first += 1
        nobody = order[:first]
        peers: dict[int, list[str]] = {}
        # Holders planned for this worker (only those can be serving it alone).
        mine = set(mine_planned.values())
        arrived = self.arrived.setdefault(digest, {})
        for index in itertools.islice(order, first, None):
            if len(peers) >= limit:
                break
            part = held(index, _NOBODY)
            struck = bad.get(index, _NOBODY)
            who: set[str] = set()
            if len(part) > 2 * HOLDERS_WEIGHED:
                # The least loaded of a random few: as good a spread as all of them (the
                # power of a few choices), at a cost per plan that does not grow with N.
                # (Whole copies made here reported every chunk: they are in ``part``.)
                who = _draw(arrived, index, part)
                who.discard(worker)
                if struck:
                    who -= struck
            if not who:
                who = set(part)
                who.update(whole)
                who.discard(worker)
                if struck:
                    who -= struck
                if not who:
                    nobody.append(index)
                    continue
            # A holder uploading to this worker alone may take more of its chunks than
            # max_uploads: the worker's window, not the directory, says how many its link
            # wants at once. Shared between peers, few at a time pass each chunk on sooner.
            free = who - busy or {w for w in who & mine if _only(uploading, w, worker)}
            if free:
                offered = sorted(free, key=lambda w: (load[w], random.random()))[:PEERS_OFFERED]
                peers[index] = offered
                mine_planned[index] = holder = offered[0]
                mine.add(holder)
                to = uploading.get(holder)
                if to is None:
                    to = uploading[holder] = Counter()
                to[worker] += 1
                load[holder] += 1
                if load[holder] >= self.max_uploads:
                    busy.add(holder)
        source: list[int] = []
        # Past SOURCE_LEASES, only a worker that nobody else copies the template with (the
        # others hold it whole, or wait for a copy on their host): nobody to pass chunks to.
        mine_leases = sum(1 for w, _ in leases.values() if w == worker)
        for index in sorted(nobody):
            if len(peers) + len(source) >= limit or len(leases) >= SOURCE_READS:
                break
            if mine_leases >= SOURCE_LEASES and (
                mine_leases >= SOURCE_READS or self.others_copying(digest, worker, whole)
            ):
                break
            if index not in leases:
                leases[index] = (worker, now + LEASE_SECONDS)
                source.append(index)
                mine_leases += 1
        return {"peers": peers, "source": source}

    def others_copying(
        self, digest: str, worker: str, whole: AbstractSet[str] | None = None
    ) -> bool:
        """Whether workers other than ``worker`` are copying the template now: they asked
        for a plan within :data:`LEASE_SECONDS`, are connected and do not hold it whole."""
        whole = self.whole_copies(digest) if whole is None else whole
        connected = self.connected()
        since = time.time() - LEASE_SECONDS
        copying = self.copying.get(digest, {})
        gone, found = [], False
        for other, asked in copying.items():
            if other == worker:
                continue
            if asked <= since or other in whole or other not in connected:
                gone.append(other)
                continue
            found = True
            break
        # Those copy no longer (a worker that loses its copy and asks again is counted
        # again): forgotten, so that the next look does not pass them again.
        for other in gone:
            del copying[other]
        return found

    def _done(self, digest: str, worker: str, index: int) -> None:
        """The upload planned for ``worker``'s chunk ``index`` (if any) is over."""
        holder = self.planned.get(digest, {}).get(worker, {}).pop(index, None)
        if holder is not None:
            self._unplan(digest, holder, worker)

    def _unplan(self, digest: str, holder: str, worker: str) -> None:
        """One upload planned from ``holder`` to ``worker`` is over."""
        self.load[digest][holder] -= 1
        if self.load[digest][holder] < self.max_uploads:
            self.busy[digest].discard(holder)
        to = self.uploading[digest][holder]
        to[worker] -= 1
        if to[worker] <= 0:
            del to[worker]

    def have(
        self,
        digest: str,
        worker: str,
        indexes: list[int],
        released: list[int] | None = None,
        lost: list[int] | None = None,
        bad: list[int] | None = None,
    ) -> None:
        """RPC handler: ``worker`` now holds ``indexes``; it no longer wants ``released``
        (its leases on them end, so do the uploads planned for them); it no longer offers
        ``lost`` (it failed to serve them, or gave up its copy); it served ``bad`` with the
        wrong bytes, so nobody is sent to it for them again."""
        if worker not in self.connected():
            return
        holders = self.holders.setdefault(digest, {})
        leases = self.leases.setdefault(digest, {})
        for index in lost or ():
            holders.get(index, set()).discard(worker)
        if bad:
            marked = self.bad_holders.setdefault(digest, {})
            first = not any(worker in who for who in marked.values())
            for index in bad:
                marked.setdefault(index, set()).add(worker)
            if first:  # once per worker and template: its copy is damaged
                logger.warning(
                    "%s served corrupted chunk(s) %s of template %s...: no longer offered for them",
                    worker,
                    bad,
                    digest[:12],
                )
        for index in indexes:
            held = holders.setdefault(index, set())
            if worker not in held:
                held.add(worker)
                self.arrived.setdefault(digest, {}).setdefault(index, []).append(worker)
            leases.pop(index, None)
            self._done(digest, worker, index)
        for index in released or ():
            if leases.get(index, ("", 0.0))[0] == worker:
                del leases[index]
            self._done(digest, worker, index)
        self._notify(digest)

    def remove_worker(self, worker: str) -> None:
        """A worker left: it holds nothing, its leases lapse, so do uploads planned to or
        from it."""
        for directory in (self.holders, self.bad_holders):
            for by_index in directory.values():
                for who in by_index.values():
                    who.discard(worker)
        for leases in self.leases.values():
            for index in [i for i, (w, _) in leases.items() if w == worker]:
                del leases[index]
        for digest, planned in self.planned.items():
            for holder in planned.pop(worker, {}).values():
                self._unplan(digest, holder, worker)
            for from_holders in planned.values():
                for index in [i for i, holder in from_holders.items() if holder == worker]:
                    del from_holders[index]
            self.load[digest].pop(worker, None)
            self.busy.get(digest, set()).discard(worker)
            self.uploading.get(digest, {}).pop(worker, None)
        for copying in self.copying.values():
            copying.pop(worker, None)
        self._notify()


def _draw(arrived: dict[int, list[str]], index: int, part: AbstractSet[str]) -> set[str]:
    """:data:`HOLDERS_WEIGHED` holders of chunk ``index`` drawn at random (fewer if some
    drawn left), in time that does not grow with their number; ``arrived``: the holders of
    each chunk in the order they came."""
    came = arrived.get(index)
    if came is None:
        return set()
    if len(came) > 2 * len(part):  # many have left: forget them
        came[:] = [w for w in came if w in part]
    if len(came) <= HOLDERS_WEIGHED:
        return {w for w in came if w in part}
    # A run of them from a random place: holders that came at about the same time are as
    # good a draw as any, and a slice costs one random number.
    start = int(random.random() * (len(came) - HOLDERS_WEIGHED + 1))
    return {w for w in came[start : start + HOLDERS_WEIGHED] if w in part}


def _only(uploading: dict[str, Counter[str]], holder: str, worker: str) -> bool:
    """Whether ``worker`` is the one peer ``holder`` has uploads planned to."""
    to = uploading.get(holder)
    return to is not None and to.keys() == {worker}
