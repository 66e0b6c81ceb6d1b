"""The attention the generic split runs (:mod:`.generic`, :mod:`.seq2seq`): SDPA whose mask function never skips
the mask (``uniap_sdpa``), so every batch has the same payload structure (plain SDPA passes ``None`` for a batch
without padding, which would change what crosses a stage boundary from batch to batch)."""

from __future__ import annotations

from typing import Any

#: the attention implementation the generic layers run with (SDPA, masks always materialized)
ATTENTION = "uniap_sdpa"


def _register_attention() -> bool:
    try:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:  # pragma: no cover - an older transformers
        return False

    def mask(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_is_causal_skip"] = False  # a mask every time (None without padding would change the payload)
        kwargs["allow_is_bidirectional_skip"] = False
        return sdpa_mask(*args, **kwargs)

    AttentionInterface.register(ATTENTION, sdpa_attention_forward)
    AttentionMaskInterface.register(ATTENTION, mask)
    return True
