"""The restore search: the one loop every load and restore runs, on one level or on several.

Every rank calls :func:`search` together, with the same candidates (copies of checkpoints, in the
order to try them: newest first; the caller agreed on them: load/agreed.py for one level,
levels/restore.py for several). For each candidate:

1. each rank reads the parts of it that it uses, alone (``read``: no collective, so that a failure
   cannot leave another rank waiting in one), every byte verified;
2. one all-gather of the verdicts; when every rank read its parts and the reading has a collective
   part (an exchange of the state's pieces, load/exchange.py, or of node-local parts,
   levels/assemble.py), that part runs on every rank, then a second all-gather of its verdicts;
3. a failure on any rank moves every rank to the next candidate together, or ends the search on
   every rank together, by one rule (:func:`ends_search`, :func:`may_try`):

   * an error that is not a :class:`CheckpointError` (a bug, a ``TypeError`` from the caller's
     ``into``, the machine's ``MemoryError``), a :class:`MismatchError` (the caller's state does not
     take the checkpoint) or a :class:`NoCheckpointError` ends the search: no other copy can help;
   * any other :class:`CheckpointError` (a checksum mismatch, a malformed file, a storage failure,
     a read too large for this process) moves on: to a copy of the same checkpoint on a slower
     level always, to another checkpoint (an older attempt or step) only with ``fallback``.

What failed is appended to ``failures``, one line per failed rank and candidate, in one form:
``"<where the candidate is>: rank <r>: <error>"``. When the search ends early, each rank raises
its own error where it failed, elsewhere a :class:`CorruptionError` naming the ranks that failed;
when every candidate failed, a :class:`CorruptionError` listing every line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Protocol, Sequence, TypeVar

from ..comm import Comm
from ..errors import CheckpointError, CorruptionError, MismatchError, NoCheckpointError

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Candidate(Protocol):
    """A copy of a checkpoint to try: its step and its directory name (the same on every level that
    holds a copy of that checkpoint)."""

    @property
    def step(self) -> int: ...

    @property
    def dirname(self) -> str: ...


C = TypeVar("C", bound=Candidate)


class Reading(Protocol[T_co]):
    """What one rank read of a candidate, alone, before the verdicts are agreed."""

    @property
    def report(self) -> dict[str, Any]:
        """What this rank tells the others with its verdict (JSON-able: the node, the parts read)."""

    @property
    def collective(self) -> bool:
        """Whether :meth:`finish` talks to the other ranks (then its verdict is agreed too)."""

    def finish(self, reports: Sequence[dict[str, Any]]) -> T_co:
        """Every rank, once every rank's reading succeeded (``reports``: every rank's, by rank):
        the result."""


@dataclass(frozen=True)
class Read(Generic[T]):
    """A reading with nothing left to do together: its result is at hand."""

    result: T
    report: dict[str, Any] = field(default_factory=dict)
    collective: bool = False

    def finish(self, reports: Sequence[dict[str, Any]]) -> T:
        return self.result


def ends_search(e: BaseException) -> bool:
    """Pure: whether an error reading a candidate ends the search (see the module docstring)."""
    return not isinstance(e, CheckpointError) or isinstance(e, (MismatchError, NoCheckpointError))


def may_try(candidate: Candidate, first: Candidate, fallback: bool) -> bool:
    """Pure: whether ``candidate`` is tried after the ones before it failed: a copy of ``first`` (the
    newest candidate: the same directory, on another level) always, any other only with ``fallback``."""
    return fallback or candidate.dirname == first.dirname


def search(candidates: Sequence[C], read: Callable[[C], Reading[T]], comm: Comm, *, rank: int, fallback: bool,
           failures: list[str], where: Callable[[C], str], scope: str) -> tuple[C, T]:
    """Every rank of ``comm`` (a ``LocalComm`` for one process alone, which reads as ``rank``): the
    first of ``candidates`` that every rank reads and verifies, and its result; see the module docstring.

    ``where(c)``: how the failures name a candidate. ``scope``: what the candidates are, for the error
    when none verifies (``"at /data/run"``, ``"on any level (...)"``). ``candidates`` must not be empty.
    """
    own: BaseException | None = None  # this rank's error on the last candidate tried
    last: tuple[C, list[dict[str, Any]]] | None = None
    reading: Reading[T] | None = None
    for c in candidates:
        if not may_try(c, candidates[0], fallback):
            break
        own, reading = None, None
        try:
            reading = read(c)
            report: dict[str, Any] = {**reading.report, "ok": True}
        except Exception as e:  # noqa: BLE001 - reported to the other ranks first, so that none waits forever
            own, report = e, _failed(rank, e)
        reports = _gather(comm, report)
        if reading is not None and all(r["ok"] for r in reports):
            try:
                result = reading.finish(reports)
                report = {"ok": True}
            except Exception as e:  # noqa: BLE001 - agreed on below when collective, as above
                own, report = e, _failed(rank, e)
            # a finish that is not collective computes from the agreed reports alone: the same on every rank
            reports = _gather(comm, report) if reading.collective else [report]
            if all(r["ok"] for r in reports):
                return c, result
        bad = [r for r in reports if not r["ok"]]
        failures.extend(f"{where(c)}: {r['error']}" for r in bad)
        last = c, bad
        if any(r["ends"] for r in bad):
            break
    if last is not None and (not fallback or any(r["ends"] for r in last[1])):
        if own is not None:
            raise own
        raise CorruptionError(f"{where(last[0])} failed on other ranks: " + "; ".join(r["error"] for r in last[1]))
    everywhere = " on every rank" if comm.world_size > 1 else ""
    raise CorruptionError(f"no checkpoint {scope} verifies{everywhere}: " + "; ".join(failures))


def _failed(rank: int, e: BaseException) -> dict[str, Any]:
    """The report of a rank whose reading failed (``ends``: no other candidate can help)."""
    return {"ok": False, "error": f"rank {rank}: {e}", "ends": ends_search(e)}


def _gather(comm: Comm, report: dict[str, Any]) -> list[dict[str, Any]]:
    return comm.all_gather(report) if comm.world_size > 1 else [report]
