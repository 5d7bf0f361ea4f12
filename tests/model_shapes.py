"""Real model shape lists for planner tests (fp32): ResNet-50 and a GPT-2-small-like transformer."""

from __future__ import annotations

from ckpt_engine.state.plan import TensorMeta


def _bn(c: int) -> list[tuple[int, ...]]:
    return [(c,), (c,), (c,), (c,), ()]  # weight, bias, running_mean, running_var, num_batches_tracked


def resnet50() -> list[tuple[int, ...]]:
    """Parameter and buffer shapes of torchvision's ResNet-50 (25.6 M parameters)."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), *_bn(64)]
    cin = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += [(width, cin, 1, 1), *_bn(width), (width, width, 3, 3), *_bn(width),
                       (width * 4, width, 1, 1), *_bn(width * 4)]
            if b == 0:
                shapes += [(width * 4, cin, 1, 1), *_bn(width * 4)]
            cin = width * 4
    return shapes + [(1000, 2048), (1000,)]


def gpt2_small(layers: int = 12, d: int = 768, vocab: int = 50257, ctx: int = 1024) -> list[tuple[int, ...]]:
    """Parameter shapes of a GPT-2-small-like transformer (124 M parameters)."""
    shapes: list[tuple[int, ...]] = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return shapes + [(d,), (d,)]


def metas(shapes: list[tuple[int, ...]], itemsize: int = 4) -> list[TensorMeta]:
    dtype = {4: "float32", 2: "bfloat16", 8: "int64", 1: "uint8"}[itemsize]
    return [TensorMeta(dtype, s, itemsize) for s in shapes]
