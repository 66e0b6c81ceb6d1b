"""A user's own LightningModule (issue 21 item 6): the README's snippet trains; one computing its loss in
``training_step`` (which the strategy never calls) is refused with one line on rank 0, every rank ending."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent('''
    import sys
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Net(L.LightningModule):
        def __init__(self, with_loss):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
            if with_loss:
                self.loss_fn = nn.CrossEntropyLoss()
        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    if __name__ == "__main__":
        torch.manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randint(0, 4, (32,)))
        trainer = L.Trainer(strategy="uniap", devices=int(sys.argv[1]), accelerator="cpu", max_steps=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(Net(with_loss=sys.argv[2] == "loss"), torch.utils.data.DataLoader(data, batch_size=8))
        if trainer.global_rank == 0:
            print(f"trained {trainer.global_step} step(s)")
''')


def _run(tmp_path: Path, devices: int, loss: str, **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "own.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, str(script), str(devices), loss], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, check=False,
                          env={**os.environ, "UNIAP_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1", **env})


def test_a_module_without_loss_is_one_line_on_rank_0(tmp_path: Path) -> None:
    res = _run(tmp_path, 2, "none")
    assert res.returncode == 1
    errors = [line for line in res.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert errors == ["error: Net has no loss the strategy can call: define uniap_loss(output, target) or a loss_fn "
                      "attribute (e.g. self.loss_fn = nn.CrossEntropyLoss()); Net.training_step is not called: the "
                      "strategy runs the layers and the loss itself, stage by stage."], res.stderr[-3000:]
    assert "[rank" not in res.stderr


def test_the_traceback_is_kept_on_request_and_a_module_with_a_loss_trains(tmp_path: Path) -> None:
    res = _run(tmp_path, 1, "none", UNIAP_TRACEBACK="1")
    assert res.returncode == 1 and "Traceback" in res.stderr and "UniAPError: Net has no loss" in res.stderr
    res = _run(tmp_path, 1, "loss")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "trained 1 step(s)" in res.stdout


def test_the_hook_leaves_other_errors_and_other_ranks_alone(capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from uniap_lightning import error_hook
    from uniap_lightning.errors import UniAPError

    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *args: seen.append(args[0]))
    error_hook.install(rank=1)
    error_hook.install(rank=0)  # again: replaces, does not stack
    sys.excepthook(UniAPError, UniAPError("bad"), None)
    sys.excepthook(RuntimeError, RuntimeError("boom"), None)
    assert capsys.readouterr().err == "error: bad\n" and seen == [RuntimeError]
    error_hook.install(rank=1)
    with pytest.raises(UniAPError) as agreed, error_hook.raised_on_every_rank():
        raise UniAPError("bad")
    sys.excepthook(UniAPError, agreed.value, None)  # setup's: rank 0 said it
    assert capsys.readouterr().err == "" and seen == [RuntimeError]
    sys.excepthook(UniAPError, UniAPError("mine alone"), None)  # not known to be on rank 0 too
    assert capsys.readouterr().err == "error: (rank 1) mine alone\n"
