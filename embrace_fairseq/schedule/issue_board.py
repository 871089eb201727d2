"""The issue board of the single-thread mode: how far each rank issued the static list
outside an agreement, readable by its peers without that rank's host.

Why (``schedule/issue.py`` has the mode): in a gradient hook a rank issues the list's
next pieces as soon as its own credit frees, so at a fence the ranks differ in how many
they issued, and the fence's host-side vote settles it. A rank that is ahead may meet a
device-wide synchronisation before its fence (the CUDA caching allocator freeing its
cache on an out-of-memory retry, ``empty_cache``, an expandable segment's unmap): its host
then waits for its device, which waits in a piece for the peer's half -- and a peer
that waits in the vote for that host would never issue it.

So before a rank issues a piece outside an agreement it posts, on the job's store, how
many pieces of this backward's list it has issued in the current segment (between two
fences); a rank waiting at a fence reads its peers' posts and issues up to the furthest
while its vote is in flight (``IssueMixin._vote_max``). No device then waits for a host
that waits for it. The store is served off the training thread (a TCP store by a thread
of its own on its server rank, a file store by the file system), so a post is readable
while the posting rank's host is blocked.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch.distributed as dist


class IssueBoard:
    """Per-rank posts ``(backward, segment, count)`` under a prefix of the job's store.

    Args:
        key: a name of the reducer, the same on every rank (its vote group's label).
        ranks: the global ranks taking part; this rank's post is its own key.
        store: the store (default: the default process group's).
    """

    def __init__(self, key: str, ranks: Sequence[int], store: Optional["dist.Store"] = None) -> None:
        if store is None:
            from torch.distributed.distributed_c10d import _get_default_store

            store = _get_default_store()
        self._store = dist.PrefixStore(f"embrace_issue_board/{key}/", store)
        me = dist.get_rank()
        self._mine = str(me)
        self._peers = [str(r) for r in ranks if r != me]
        self.post(-1, 0, 0)  # every key exists once every rank built its board: one read for all

    def post(self, backward: int, segment: int, count: int) -> None:
        """This rank has issued (or is about to issue) ``count`` pieces of the list."""
        self._store.set(self._mine, f"{backward} {segment} {count}")

    def furthest(self, backward: int, segment: int) -> int:
        """The largest count a peer posted for this backward and segment (0: none). A post
        of another segment is ignored: a peer past the fence issues the next segment's
        pieces after the collective this rank is about to issue."""
        if self._store.check(self._peers):
            posts = self._store.multi_get(self._peers)
        else:  # a peer has not built its board yet: it has posted nothing
            posts = [self._store.get(p) for p in self._peers if self._store.check([p])]
        best = 0
        for post in posts:
            b, s, c = (int(x) for x in post.decode().split())
            if b == backward and s == segment:
                best = max(best, c)
        return best
