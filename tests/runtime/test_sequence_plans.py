"""Plans with context parallelism (Ulysses, ``cp``) and sequence parallelism (``sp``) run under
``Trainer(strategy="uniap")``: 5 SGD steps match one process (loss and every parameter within 1e-5).

Cases are pinned plans (``make_plan`` with dict strategies) over the plain GPT chain and the Hugging Face Llama
chain (``uniap_rt_helpers.make_lm_module``); the 2-rank cases share one spawn, the 4-rank ones another (the heavier
ones slow).
"""

from __future__ import annotations

from typing import Any

import pytest

import uniap_rt_helpers as h

NAMES = ["chain.0", "chain.1", "chain.2", "chain.3"]  # embedding, block, block, norm + head
CP2 = {"cp": 2}
ONE = {"dp": 2}  # cp 1 on two ranks: the batch over both


def _plan(strategies: list[Any], stages: list[int] | None = None, *, pp: int = 1, microbatches: int = 1,
          world: int = 2) -> Any:
    return h.make_plan(strategies, stages or [0] * 4, pp=pp, microbatches=microbatches, world=world, names=NAMES)


def padded_lm_data(batch_size: int, n: int = 64, seed: int = 1) -> Any:
    """Token ids with the last 3 labels of every sample -100 (padding the loss ignores): the second half of each
    sequence holds more ignored tokens than the first."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, h.VOCAB, (n, h.SEQ), generator=g)
    labels = ids.clone()
    labels[:, -3:] = -100
    return DataLoader(TensorDataset(ids, labels), batch_size=batch_size, drop_last=True)


TWO_RANKS = {
    "gpt_cp2": {"module": {"lm": "gpt"}, "plan": _plan([CP2] * 4)},
    "gpt_tp2_sp": {"module": {"lm": "gpt"}, "plan": _plan([{"tp": 2}, {"tp": 2, "sp": True}, {"tp": 2, "sp": True},
                                                           {"tp": 2}])},
    "gpt_cp2_padded": {"module": {"lm": "gpt"}, "plan": _plan([CP2] * 4),
                       "data": {"factory": "test_sequence_plans:padded_lm_data"}},
    "gpt_cp2_next_to_dp2": {"module": {"lm": "gpt"}, "plan": _plan([ONE, CP2, ONE, CP2], microbatches=2)},
    "llama_cp2": {"module": {"lm": "llama"}, "plan": _plan([CP2] * 4)},
}


@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_two_ranks_match_one_process(spawn_cases: Any, name: str) -> None:
    results = spawn_cases(2, TWO_RANKS, "sequence_plans2")
    h.assert_close_to_reference(results, name, h.reference_for(TWO_RANKS[name]))
