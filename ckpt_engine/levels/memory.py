"""The node-memory level: where it lives on a node, who owns it, which ranks are peers, what fits.

A memory level is the first of the levels: a directory in the node's shared memory (``/dev/shm``
or a tmpfs the user names), below ``<root>/<job>/node-<node>/``. It survives the training
processes (SIGKILL, an OOM kill, a ``torchrun`` restart) but not the node. Every rank commits its
own part there (``rank-NNNNN/``, as on any node-local level: levels/open.py) and sends a copy to
``replicas`` peer ranks on other nodes (levels/replicate.py), which keep it below the sender's
``rank-NNNNN/`` in *their* node's directory. A restore assembles a checkpoint from whatever the
nodes hold (levels/restore.py), so a node replaced by an empty one gets its ranks' parts back
from its peers.

**A node** is what the launcher says: ``CKPT_NODE`` when set (tests run several simulated nodes on
one machine), else torchrun's ``GROUP_RANK``, else Horovod's ``HOROVOD_CROSS_RANK``, else the host
name. The ranks gather these keys once at open (:class:`NodeTable`).

**The job** that owns a node's memory is ``job`` when configured, else a tag derived from the
other levels' locations (the job that owns those paths: a restarted job finds its memory again),
else from the memory path. Each process that opens the level claims it (``owners/``: pid and the
process's start time); at open, the directories of *other* jobs on this node none of whose
claimants is still alive are removed (:func:`sweep_dead_jobs`), and ``ckpt gc --memory`` does the
same by hand. ``close()`` removes the node's directory once the slower levels hold its newest
checkpoint.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import re
import shutil
import socket
from dataclasses import dataclass
from typing import Any, Sequence

import xxhash

from ..config import LevelSpec
from ..errors import CheckpointError
from ..storage import StorageWrapper

OWNERS = "owners"
"""Below a node's directory: one claim file per process that uses it."""
_NODE_NAME = re.compile(r"[^A-Za-z0-9_.-]")


def node_key(environ: "os._Environ[str] | dict[str, str] | None" = None) -> str:
    """This process's node, as the launcher says (see the module docstring); safe as a path part."""
    env = os.environ if environ is None else environ
    for name in ("CKPT_NODE", "GROUP_RANK", "HOROVOD_CROSS_RANK"):
        if env.get(name, "") != "":
            return _NODE_NAME.sub("_", env[name])[:64]
    return _NODE_NAME.sub("_", socket.gethostname())[:64] or "node"


_MEMORY_FS = {0x01021994, 0x858458F6}
"""``statfs`` magic numbers of the filesystems that keep files in memory: tmpfs, ramfs."""


def in_memory_fs(path: str) -> bool:
    """Whether ``path`` is on a filesystem that keeps its files in memory (Linux ``statfs``); ``False``
    where that cannot be told. Only there do readers map files (``Storage.in_memory``): a disk's read
    error would reach a mapping as SIGBUS instead of an exception."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        buf = ctypes.create_string_buffer(256)  # struct statfs; f_type is its first field, a long
        if libc.statfs(os.fsencode(path), buf) != 0:
            return False
    except (OSError, AttributeError):
        return False
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF in _MEMORY_FS


def job_tag(spec: LevelSpec, others: Sequence[LevelSpec]) -> str:
    """The owner of the memory level ``spec``: its ``job``, else a tag of the other levels' places."""
    if spec.job:
        return spec.job
    places = [_place(s.location) for s in others] or [_place(spec.location)]
    return "job-" + xxhash.xxh3_64_hexdigest("\n".join(places).encode())[:12]


def _place(location: str) -> str:
    """A level's location as the job's identity: a local path made absolute (the same directory
    from any working directory), a URL as it is."""
    path = location.removeprefix("file://")
    return path.rstrip("/") if "://" in path else os.path.abspath(path)


def node_dir(spec: LevelSpec, job: str, node: str) -> str:
    """The directory of ``node``'s memory for ``job``."""
    return os.path.join(spec.location.removeprefix("file://"), job, f"node-{node}")


@dataclass(frozen=True)
class NodeTable:
    """Which node each rank is on (indices in order of first appearance), and who replicates to whom."""

    nodes: tuple[int, ...]

    @staticmethod
    def of(keys: Sequence[str]) -> "NodeTable":
        """From every rank's node key, by rank."""
        index: dict[str, int] = {}
        return NodeTable(tuple(index.setdefault(k, len(index)) for k in keys))

    @property
    def count(self) -> int:
        return max(self.nodes, default=-1) + 1

    def ranks_on(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.nodes) if n == node]

    def local_world(self, rank: int) -> int:
        return len(self.ranks_on(self.nodes[rank]))

    def peers(self, rank: int, replicas: int) -> list[int]:
        """The ranks ``rank`` sends its part to: one on each of the next ``replicas`` nodes (as
        many as there are other nodes), the one at the same position among that node's ranks
        (wrapping when that node has fewer), so that the load spreads over the receivers."""
        node, nodes = self.nodes[rank], self.count
        position = self.ranks_on(node).index(rank)
        out = []
        for k in range(1, min(replicas, nodes - 1) + 1):
            there = self.ranks_on((node + k) % nodes)
            out.append(there[position % len(there)])
        return out

    def sources(self, rank: int, replicas: int) -> list[list[int]]:
        """Per replica round ``k``, the ranks that send to ``rank`` in it (the inverse of :meth:`peers`)."""
        rounds = min(replicas, self.count - 1)
        out: list[list[int]] = [[] for _ in range(rounds)]
        for sender in range(len(self.nodes)):
            for k, peer in enumerate(self.peers(sender, replicas)):
                if peer == rank:
                    out[k].append(sender)
        return out


class NodeParts(StorageWrapper):
    """A node's memory directory (the storage wrapped) seen as one checkpoint root:
    ``<dir>/rank-NNNNN.bin`` and ``.index.json`` are read from ``rank-NNNNN/<dir>/`` (where each part
    lives, own or replica), so that the ordinary reader reads a checkpoint whose every part this node
    holds, with no exchange. Reading only."""

    def path(self, *parts: str) -> str:
        return super().path(_where("/".join(parts)))

    def describe(self, *parts: str) -> str:
        return super().describe(_where("/".join(parts)))

    def read_bytes(self, rel: str, *args: Any, **kwargs: Any) -> bytes:
        return super().read_bytes(_where(rel), *args, **kwargs)

    def regular_size(self, rel: str) -> int | None:
        return super().regular_size(_where(rel))

    def reader(self, rel: str) -> Any:
        return super().reader(_where(rel))

    def exists(self, rel: str) -> bool:
        return super().exists(_where(rel))


def _where(rel: str) -> str:
    """Where a part's file of a checkpoint directory lives in a node's memory (other paths: as they are)."""
    m = _PART.fullmatch(rel)
    return f"{m.group(2)}/{m.group(1)}/{m.group(2)}{m.group(3)}" if m is not None else rel


_PART = re.compile(r"(step-[0-9]+-[0-9a-z]+)/(rank-[0-9]{5,})(\.bin|\.index\.json)")


# ---- owners and sweeping ----------------------------------------------------------------------
def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks after boot), ``None`` when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def claim(directory: str, rank: int) -> None:
    """Record that this process (``rank``) uses the node directory ``directory``."""
    owners = os.path.join(directory, OWNERS)
    os.makedirs(owners, exist_ok=True)
    doc = {"pid": os.getpid(), "start": _start_time(os.getpid()), "boot": _boot_id(), "rank": rank}
    tmp = os.path.join(owners, f".tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    os.replace(tmp, os.path.join(owners, f"pid-{os.getpid()}.json"))


def release(directory: str) -> None:
    """This process no longer uses ``directory`` (its claim removed)."""
    try:
        os.remove(os.path.join(directory, OWNERS, f"pid-{os.getpid()}.json"))
    except OSError:
        pass


def alive_owners(directory: str) -> list[int]:
    """The pids of the processes that claimed ``directory`` and still run (same boot, same start)."""
    owners = os.path.join(directory, OWNERS)
    try:
        names = os.listdir(owners)
    except OSError:
        return []
    boot, out = _boot_id(), []
    for name in names:
        try:
            with open(os.path.join(owners, name), encoding="utf-8") as f:
                doc = json.load(f)
            pid = int(doc["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if doc.get("boot") == boot and _start_time(pid) is not None and _start_time(pid) == doc.get("start"):
            out.append(pid)
    return out


def dead_node_dirs(root: str, job: str | None = None, node: str | None = None) -> list[str]:
    """The node directories below ``root`` of jobs other than ``job`` (``None``: any job) none of
    whose claimants is alive; only ``node``'s when given (what the sweep and ``ckpt gc --memory`` remove)."""
    found = []
    try:
        jobs = sorted(os.listdir(root))
    except OSError:
        return []
    for other in jobs:
        job_path = os.path.join(root, other)
        if other == job or not os.path.isdir(job_path) or os.path.islink(job_path):
            continue
        for name in sorted(os.listdir(job_path)):
            path = os.path.join(job_path, name)
            if not name.startswith("node-") or (node is not None and name != f"node-{node}"):
                continue
            if os.path.isdir(path) and not os.path.islink(path) and not alive_owners(path):
                found.append(path)
    return found


def sweep_dead_jobs(root: str, job: str | None, node: str | None = None) -> list[str]:
    """Remove :func:`dead_node_dirs` (and job directories left empty); returns the removed paths."""
    removed = dead_node_dirs(root, job, node)
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(path))  # only when empty
        except OSError:
            pass
    return removed


def remove_node_dir(directory: str) -> None:
    """Remove a node's memory directory (``close()`` once the slower levels hold its newest checkpoint),
    unless another process of the job on this node still claims it."""
    release(directory)
    if not alive_owners(directory):
        shutil.rmtree(directory, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(directory.rstrip("/")))
        except OSError:
            pass


# ---- what fits ----------------------------------------------------------------------------------
def node_footprint(rank_bytes: int, local_world: int, replicas: int) -> int:
    """Bytes one checkpoint takes in a node's memory: its ranks' parts and the replicas it keeps
    (each rank receives as many parts as it sends: ``replicas``), from this rank's part size."""
    return rank_bytes * local_world * (1 + replicas)


def check_room(directory: str, rank_bytes: int, local_world: int, replicas: int, budget: int | None) -> int:
    """Refuse a memory level that cannot hold one checkpoint plus the one being written; returns
    how many checkpoints fit (``None`` budget: what the filesystem can hold).

    Raises :class:`CheckpointError` with the numbers: the checkpoint's footprint on the node, the
    budget, and the memory filesystem's size.
    """
    footprint = node_footprint(rank_bytes, local_world, replicas)
    st = os.statvfs(directory)
    size = st.f_blocks * st.f_frsize
    limit = size if budget is None else min(budget, size)
    what = (f"one checkpoint takes {footprint} bytes of this node's memory ({local_world} rank(s) x {rank_bytes} "
            f"bytes x (1 + {replicas} replica(s)))")
    if 2 * footprint > limit:
        holds = f"the memory level's budget is {budget} bytes" if budget is not None and budget < size else \
            f"{directory} holds {size} bytes"
        raise CheckpointError(f"memory level {directory}: {what}, and a save needs room for two (the newest and "
                              f"the one being written), but {holds}; raise 'budget', give the tmpfs more room, or "
                              "lower 'replicas'")
    return limit // footprint - 1
