"""Where checkpoints go and come from: a ``Checkpointer``'s destination (:mod:`.destination`), one path
(:mod:`.single`) or several levels: levels opened and checked together (:mod:`.open`), level 1's
commit, one committer per kind (:mod:`.first`: shared or node-local; :mod:`.first_memory`: a
node-memory level, :mod:`.memory`, replicated to peers by :mod:`.replicate`), composed with
background flushers to the lower levels (:mod:`.flush`, copying with :mod:`.transfer`) into the
destination of a ``Checkpointer`` with several levels (:mod:`.multilevel`), and restoring from the
fastest level that verifies (:mod:`.restore`; from the parts the nodes hold: :mod:`.assemble`).
:mod:`.scale` runs the memory level on paper at any number of nodes."""

from __future__ import annotations

from typing import Sequence

from ..comm import Comm
from ..config import LevelSpec
from ..save.tally import Tally
from .destination import Destination
from .multilevel import MultiLevel
from .single import SingleLevel


def open_destination(specs: Sequence[LevelSpec], comm: Comm, readonly: bool, commit_timeout: float,
                     flush_retries: int, tally: Tally) -> Destination:
    """Every rank (a collective): one path is a single level; several levels are flushed in the background."""
    if len(specs) == 1 and not specs[0].memory:
        return SingleLevel(specs[0], comm, readonly=readonly)
    return MultiLevel(specs, comm, commit_timeout=commit_timeout, retries=flush_retries, tally=tally)
