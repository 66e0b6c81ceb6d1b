"""Hugging Face GPT-2 and Llama (small configs, random weights) and the plain-PyTorch GPT train under pinned plans
through the adapters, matching one process; GPT-2 blocks refuse tensor parallelism with a clear error."""

from __future__ import annotations

from typing import Any

import pytest

import uniap_rt_helpers as h

pytest.importorskip("transformers")  # the [hf] extra
from uniap_lightning.errors import UniAPError

NAMES = ["chain.0", "chain.1", "chain.2", "chain.3"]  # embedding, block, block, norm + head


def _plan(strategies: list[tuple[int, int, bool]], stages: list[int], **kw: Any) -> Any:
    return h.make_plan(strategies, stages, names=NAMES, **kw)


REPL, FSDP, TP = (2, 1, False), (2, 1, True), (1, 2, False)
CASES = {
    "gpt2_pp2": {"module": {"lm": "gpt2"}, "plan": _plan([(1, 1, False)] * 4, [0, 0, 1, 1], pp=2, microbatches=2)},
    "gpt2_dp2_fsdp_mixed": {"module": {"lm": "gpt2"}, "plan": _plan([FSDP, REPL, FSDP, REPL], [0] * 4, pp=1,
                                                                    microbatches=1)},
    "llama_tp2": {"module": {"lm": "llama"}, "plan": _plan([TP] * 4, [0] * 4, pp=1, microbatches=1)},
    "llama_mixed": {"module": {"lm": "llama"}, "plan": _plan([FSDP, TP, TP, REPL], [0] * 4, pp=1, microbatches=2)},
    "gpt_pp2_1f1b": {"module": {"lm": "gpt"}, "plan": _plan([(1, 1, False)] * 4, [0, 1, 1, 1], pp=2, microbatches=4)},
    "gpt_tp2": {"module": {"lm": "gpt"}, "plan": _plan([TP] * 4, [0] * 4, pp=1, microbatches=1)},
}
DEFAULT = ["gpt2_pp2", "llama_mixed", "gpt_tp2"]


@pytest.mark.parametrize(
    "name", [n if n in DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in CASES]
)
def test_adapter_models_match_one_process(name: str, spawn_cases: Any, request: pytest.FixtureRequest) -> None:
    # The default set runs in one group of processes; with -m slow included, everything runs in one larger group.
    selected = {n: CASES[n] for n in CASES if n in DEFAULT or "not slow" not in (request.config.option.markexpr or "")}
    results = spawn_cases(2, selected, "adapters_" + "_".join(sorted(selected)))
    h.assert_close_to_reference(results, name, h.reference_for(CASES[name]))


def test_gpt2_blocks_refuse_tensor_parallel() -> None:
    from uniap_lightning.adapters import extract_chain
    from uniap_lightning.runtime import check_plan_executable

    module = h.make_lm_module("gpt2")
    plan = _plan([TP] * 4, [0] * 4, pp=1, microbatches=1)
    with pytest.raises(UniAPError, match="layer 'chain.1' \\(GPT2SequenceBlock\\) has no tensor-parallel plan"):
        check_plan_executable(plan, extract_chain(module))


def test_unknown_hf_model_and_tied_embeddings_are_refused() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from uniap_lightning.adapters import hf_layers

    with pytest.raises(UniAPError, match="no UniAP adapter for Hugging Face model_type=None"):
        hf_layers(object())
    tied = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2,
                                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=0))
    with pytest.raises(UniAPError, match="tie_word_embeddings=False"):
        hf_layers(tied)
