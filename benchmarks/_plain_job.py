"""The one plain PyTorch job (no front end): its models, its data and its training loop, with the hooks a
checkpointer needs, and the paired rounds its comparisons run in. ``bench_exact_ddp`` runs it under DDP
on gloo ranks, ``bench_exact_horovod`` under Horovod's ``DistributedOptimizer``, ``bench_gpu`` on one
device with ours or DCP checkpointing it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

Hook = Optional[Callable[[], None]]


def mlp(depth: int, width: int, act: type[nn.Module] = nn.GELU, head: int = 0) -> nn.Sequential:
    """``depth`` blocks of ``Linear(width, width)``, ``LayerNorm(width)`` and ``act()`` (a tensor of width²
    elements and three of width each), then ``Linear(width, head)`` where ``head`` is not 0; from seed 0,
    the same weights on every rank and in every job."""
    torch.manual_seed(0)
    layers = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.LayerNorm(width), act())]
    return nn.Sequential(*layers, *([nn.Linear(width, head)] if head else []))


class Block(nn.Module):
    """A GPT-2 block: pre-norm causal attention and a 4x MLP, each with its residual."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A GPT-2-shaped language model (tied embedding); ``forward`` returns the loss."""

    def __init__(self, vocab: int, seq: int, d: int, layers: int, heads: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as GPT-2

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def train(loss: Callable[[Any], torch.Tensor], opt: torch.optim.Optimizer, batches: Sequence[Any], steps: int,
          first: int = 0, before_step: Hook = None, before_opt: Hook = None,
          after: Optional[Callable[[int], None]] = None) -> list[float]:
    """Seconds of each of ``steps`` optimizer steps, numbered from ``first + 1`` (step ``s`` takes batch
    ``s - 1``, cycling): ``loss(batch)``, its backward, ``before_opt()`` (a deferred snapshot's end), the
    optimizer's step and ``zero_grad``, ``loss.item()`` (as a logging loop does), ``after(s)`` (a
    checkpoint's decision); ``before_step()`` (a barrier) runs untimed ahead of each."""
    times = []
    for step in range(first + 1, first + steps + 1):
        if before_step is not None:
            before_step()
        start = time.perf_counter()
        value = loss(batches[(step - 1) % len(batches)])
        value.backward()
        if before_opt is not None:
            before_opt()
        opt.step()
        opt.zero_grad()  # to None (Horovod's optimizer takes no argument)
        value.item()
        if after is not None:
            after(step)
        times.append(time.perf_counter() - start)
    return times


def batches(rank: int, count: int, *shapes: tuple[int, ...]) -> list[tuple[torch.Tensor, ...]]:
    """``count`` batches, each a random tensor per shape of ``shapes``, from a generator seeded with ``rank``
    (each rank its own data)."""
    g = torch.Generator().manual_seed(rank)
    return [tuple(torch.randn(*shape, generator=g) for shape in shapes) for _ in range(count)]


def rotated(names: Sequence[str], r: int) -> list[str]:
    """The order of ``names`` in round ``r``: each first in turn, so that order cancels over rounds."""
    k = r % len(names)
    return [*names[k:], *names[:k]]


def paired(base: Sequence[float], other: Sequence[float]) -> dict[str, float]:
    """``other`` against ``base`` round by round (a contender's figure and the reference's of the same round):
    the median difference (``diff``) and ratio (``ratio``, over rounds where ``base`` is positive), and the
    relative difference's median, mean and standard error (``rel_median``, ``rel_mean``, ``rel_se``)."""
    from _fit_figures import Paired

    ratios = [o / b for o, b in zip(other, base) if b > 0]
    rel = Paired(tuple(r - 1 for r in ratios))
    return {"diff": statistics.median(o - b for o, b in zip(other, base)), "ratio": statistics.median(ratios),
            "rel_median": rel.median, "rel_mean": rel.mean, "rel_se": rel.se}
