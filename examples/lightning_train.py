"""A tiny character-level transformer language model, trained with Lightning and checkpointed by
``AsyncShardedCheckpoint`` — configured from YAML through LightningCLI::

    .venv/bin/python examples/lightning_train.py fit --config examples/lightning_cli.yaml

The corpus is generated from a fixed seed (no download). The callback section of the YAML is
all the checkpointing configuration there is; kill the job at any time and run the same command
again: it resumes from the newest committed checkpoint, mid-epoch, at the next unseen sample.
"""

from __future__ import annotations

import random

import pytorch_lightning as pl
import torch
from pytorch_lightning.cli import LightningCLI
from torch.utils.data import DataLoader, Dataset

WORDS = ("checkpoint snapshot persist commit manifest rank slice layer tensor buffer storage bucket "
         "resume epoch sample gradient optimizer scheduler budget overhead").split()


def corpus(n_chars: int = 40_000, seed: int = 7) -> str:
    rng = random.Random(seed)
    out, size = [], 0
    while size < n_chars:
        sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) + ". "
        out.append(sentence)
        size += len(sentence)
    return "".join(out)


class Windows(Dataset):
    """Fixed-length character windows of the corpus (inputs and next-character targets)."""

    def __init__(self, text: str, seq_len: int) -> None:
        self.vocab = sorted(set(text))
        ids = torch.tensor([self.vocab.index(c) for c in text])
        self.seq_len = seq_len
        self.data = ids

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i: int):
        chunk = self.data[i * self.seq_len:(i + 1) * self.seq_len + 1]
        return chunk[:-1], chunk[1:]


class TextData(pl.LightningDataModule):
    def __init__(self, seq_len: int = 64, batch_size: int = 16, num_workers: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.dataset = Windows(corpus(), seq_len)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.hparams.batch_size, shuffle=True,
                          num_workers=self.hparams.num_workers, persistent_workers=self.hparams.num_workers > 0)


class TinyLM(pl.LightningModule):
    def __init__(self, vocab_size: int = 32, d_model: int = 128, layers: int = 2, heads: int = 4,
                 seq_len: int = 64, dropout: float = 0.1, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = torch.nn.Embedding(vocab_size, d_model)
        self.pos = torch.nn.Parameter(torch.zeros(seq_len, d_model))
        layer = torch.nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers)
        self.head = torch.nn.Linear(d_model, vocab_size)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(seq_len))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[: x.shape[1]]
        return self.head(self.encoder(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    torch.set_num_threads(1)  # two CPU ranks share this machine's cores
    LightningCLI(TinyLM, TextData, seed_everything_default=1234)


if __name__ == "__main__":
    main()
