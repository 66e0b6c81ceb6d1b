"""Shipped defaults are valid for every shipped model on the shipped corpus (issue 21 item 3): `uniap train`'s
config check runs for each conf/model entry without training; ``auto`` Trainer values follow the corpus."""

from __future__ import annotations

import pytest

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.config import available

NOT_LANGUAGE_MODELS = {"swin_huge", "t5_large", "vit_huge"}  # image models and an encoder-decoder
#: contexts longer than the shipped demo corpus (for planning long-sequence clusters; training them needs your data)
LONGER_THAN_THE_CORPUS = {"llama_8b_128k"}


def _checked(*overrides: str):
    from uniap_lightning.cli.overrides import compose_checked
    from uniap_lightning.cli.train import check_config

    cfg = compose_checked("fit", list(overrides))
    return cfg, check_config(cfg)


@pytest.mark.parametrize("model", available("model"))
def test_every_shipped_model_passes_the_train_check_with_the_defaults(model: str) -> None:
    from uniap_lightning.cli.train_checks import corpus_tokens

    if model in NOT_LANGUAGE_MODELS:
        with pytest.raises(UniAPError, match="trains GPT-style language models"):
            _checked(f"model={model}")
        return
    if model in LONGER_THAN_THE_CORPUS:  # one clear line saying what to change, before any work
        with pytest.raises(UniAPError, match=r"gives 0 samples of \d[\d,]* tokens, fewer than one batch; use "
                                             r"data.seq_len <= [\d,]+$") as err:
            _checked(f"model={model}")
        assert "\n" not in str(err.value)
        return
    cfg, notes = _checked(f"model={model}")
    seq_len, batch = int(cfg.data.seq_len or cfg.model.seq_len), int(cfg.data.batch_size)
    train_tokens, val_tokens = corpus_tokens()
    epoch = (train_tokens // seq_len) // batch
    interval, val_batches = cfg.trainer.val_check_interval, cfg.trainer.limit_val_batches
    assert isinstance(interval, int) and 1 <= interval <= min(10, epoch)  # what Lightning demands at fit
    assert isinstance(val_batches, int) and 0 <= val_batches <= 4
    assert val_batches * batch <= val_tokens // seq_len  # never asks for more than the validation split holds
    assert (val_batches == 0) == any("no validation" in n for n in notes)
    assert all("\n" not in n for n in notes)


def test_auto_values_for_a_large_model() -> None:
    cfg, notes = _checked("model=gpt2_small")  # 1,024 tokens: 5 training batches of 16, 4 validation sequences
    assert cfg.trainer.val_check_interval == 5 and cfg.trainer.limit_val_batches == 0
    assert notes == ["no validation (trainer.limit_val_batches=auto): the corpus's validation split (4,969 tokens) "
                     "holds 4 sequence(s) of 1,024 tokens, less than one batch of 16"]
    cfg, notes = _checked("model=gpt2_small", "data.batch_size=2")  # 46 batches, 2 validation batches
    assert cfg.trainer.val_check_interval == 10 and cfg.trainer.limit_val_batches == 2 and notes == []
    cfg, notes = _checked("model=tiny_gpt", "+trainer.limit_train_batches=3")
    assert cfg.trainer.val_check_interval == 3 and cfg.trainer.limit_val_batches == 4
    assert notes == ["validating every 3 batches (trainer.val_check_interval=auto): an epoch of the corpus has 3 "
                     "batches of 16 x 64 tokens"]


def test_values_given_by_hand_are_checked_as_given() -> None:
    with pytest.raises(UniAPError, match=r"trainer.val_check_interval=50: an epoch has 46 training batches"):
        _checked("model=gpt2_small", "trainer.val_check_interval=50", "data.batch_size=2")
    with pytest.raises(UniAPError, match="validation split .* fewer than one batch"):
        _checked("model=gpt2_small", "trainer.limit_val_batches=1")
    cfg, _ = _checked("model=tiny_gpt", "trainer.val_check_interval=0.5", "trainer.limit_val_batches=1")
    assert cfg.trainer.val_check_interval == 0.5 and cfg.trainer.limit_val_batches == 1
