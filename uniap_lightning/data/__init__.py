"""Small datasets shipped with the project (nothing is downloaded).

* :class:`TextDataModule`: character-level language modelling on ``corpus.txt`` (about 100 KB of real English:
  the Zen of Python and documentation of the Python standard library), ASCII vocabulary of 128 tokens.
* :class:`ShapesDataModule`: a tiny generated image set (squares, discs, crosses, stripes in random places and
  colours), deterministic for a seed, for the ViT example.

Batches are ``(inputs, targets)``: the model contract of ``strategy="uniap"``. For text the targets are the
inputs themselves and the loss shifts them by one (as :class:`~uniap_lightning.adapters.CausalLMModule` and
Hugging Face do).
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib import resources

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset

VOCAB_SIZE = 128


def corpus_text() -> str:
    return resources.files("uniap_lightning.data").joinpath("corpus.txt").read_text()


def encode(text: str) -> torch.Tensor:
    return torch.tensor([min(ord(ch), VOCAB_SIZE - 1) for ch in text], dtype=torch.long)


def decode(ids) -> str:
    return "".join(chr(int(i)) for i in ids)


class _Windows(Dataset):
    def __init__(self, ids: torch.Tensor, seq_len: int) -> None:
        self.ids, self.seq_len = ids, seq_len

    def __len__(self) -> int:
        return len(self.ids) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.ids[i * self.seq_len : (i + 1) * self.seq_len]
        return chunk, chunk  # labels = inputs; the loss shifts them (Hugging Face convention)


class ResumableOrder(Sampler[int]):
    """The order of each epoch follows from ``(seed, epoch)`` alone (a permutation when ``shuffle``), so a run
    resumed in the middle of an epoch continues with the very samples it would have seen: the first epoch it
    iterates is ``epoch``, starting after ``skip`` samples; each later ``iter()`` is the next epoch, whole.

    ``len()`` is the whole epoch: Lightning counts the resumed epoch's batches from where it stopped.
    """

    def __init__(self, n: int, *, shuffle: bool, seed: int, epoch: int = 0, skip: int = 0) -> None:
        self.n, self.shuffle, self.seed, self.epoch, self.skip = n, shuffle, seed, epoch, skip

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        else:
            order = list(range(self.n))
        start, self.skip, self.epoch = self.skip, 0, self.epoch + 1
        return iter(order[start:])

    def __len__(self) -> int:
        return self.n


class TextDataModule(L.LightningDataModule):
    """Next-character prediction on the shipped corpus; 95% train, 5% validation, no shuffling across runs
    unless ``shuffle=True`` (seeded).

    Resumable mid-epoch: a training loader built while Lightning restores a checkpoint (``ckpt_path=``) starts at
    the checkpoint's epoch and skips the batches that epoch had completed (:class:`ResumableOrder`), so a run
    stopped at any batch (preemption) and resumed sees the same data as one that never stopped.
    """

    def __init__(self, *, seq_len: int = 64, batch_size: int = 16, shuffle: bool = False, seed: int = 0) -> None:
        super().__init__()
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len={seq_len} and batch_size={batch_size} must be >= 1")
        self.seq_len, self.batch_size, self.shuffle, self.seed = seq_len, batch_size, shuffle, seed
        ids = encode(corpus_text())
        cut = int(len(ids) * 0.95)
        self.train_set, self.val_set = _Windows(ids[:cut], seq_len), _Windows(ids[cut:], seq_len)

    def train_dataloader(self) -> DataLoader:
        epoch, skip_batches = self._resume_point()
        order = ResumableOrder(len(self.train_set), shuffle=self.shuffle, seed=self.seed, epoch=epoch,
                               skip=skip_batches * self.batch_size)
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=order, drop_last=True)

    def _resume_point(self) -> tuple[int, int]:
        """(epoch, batches of it already trained) when Lightning is restoring a fit, else (0, 0)."""
        trainer = self.trainer
        if trainer is None or not trainer.fit_loop.restarting:
            return 0, 0
        return trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_progress.current.completed

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, drop_last=True)


def shapes_dataset(n: int, *, image_size: int = 32, seed: int = 0) -> TensorDataset:
    """``n`` RGB images of one of four shapes (the label) on a noisy background."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 3, image_size, image_size, generator=g) * 0.2
    y = torch.randint(0, 4, (n,), generator=g)
    yy, xx = torch.meshgrid(torch.arange(image_size), torch.arange(image_size), indexing="ij")
    for i in range(n):
        cx, cy = torch.randint(8, image_size - 8, (2,), generator=g).tolist()
        colour = torch.rand(3, 1, 1, generator=g) * 0.7 + 0.3
        r = int(torch.randint(4, 7, (1,), generator=g))
        kind = int(y[i])
        if kind == 0:
            mask = ((yy - cy).abs() <= r) & ((xx - cx).abs() <= r)
        elif kind == 1:
            mask = (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
        elif kind == 2:
            mask = (((yy - cy).abs() <= 1) & ((xx - cx).abs() <= r)) | (((xx - cx).abs() <= 1) & ((yy - cy).abs() <= r))
        else:
            mask = ((yy // 2) % 2 == 0) & ((yy - cy).abs() <= r) & ((xx - cx).abs() <= r)
        x[i] = torch.where(mask, colour.expand(3, image_size, image_size), x[i])
    return TensorDataset(x, y)


class ShapesDataModule(L.LightningDataModule):
    def __init__(self, *, n_train: int = 512, n_val: int = 128, image_size: int = 32, batch_size: int = 32,
                 seed: int = 0) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.train_set = shapes_dataset(n_train, image_size=image_size, seed=seed)
        self.val_set = shapes_dataset(n_val, image_size=image_size, seed=seed + 1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, drop_last=True)
