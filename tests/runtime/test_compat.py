"""The transformers version gates of ``uniap_lightning/adapters/families/compat.py``: each test checks the branch the
installed release takes and that the other branch does not fit it (so a wrong gate fails here). The default run
covers the newest release's branches; ``tests/ecosystem/test_transformers_oldest.py`` runs this module against the
oldest supported release (4.57), which takes the other branches."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")  # the [hf] extra
from packaging.version import Version  # noqa: E402

from uniap_lightning.adapters.families import compat  # noqa: E402

GATES = ("T5_SCALE_CONFIG", "INPUTS_EMBEDS", "NO_CACHE_POSITION", "CACHE_ARGUMENT", "BIDIRECTIONAL_MASK",
         "VISION_PROJECTIONS", "T5_MASK_IN_POSITION_BIAS", "T5_BLOCK_CACHE_POSITION", "BERT_HEADS_FROM_SHAPE",
         "T5_HEADS_FROM_SHAPE")
NEWEST, OLDEST = Version("5.25"), Version(compat.OLDEST)


def _other(gate: str) -> Version:
    """A release on the other side of ``gate`` from the installed one."""
    return OLDEST if compat.at_least(gate) else NEWEST


def _config(attention: str = "eager") -> object:
    import transformers as tr

    config = tr.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8)
    config._attn_implementation = attention
    return config


def _padded() -> tuple[torch.Tensor, torch.Tensor]:
    hidden = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    return hidden, mask


def _allowed(mask: torch.Tensor) -> torch.Tensor:
    """Where a 4-D mask lets a query attend: True entries of a boolean one, zeros of an additive one."""
    return mask if mask.dtype == torch.bool else mask == 0


def test_installed_release_is_the_imported_one_and_in_the_cache_key() -> None:
    import transformers

    from uniap_lightning.profiling.cache import versions

    assert compat.installed() == Version(Version(transformers.__version__).base_version)
    assert compat.installed() >= Version(compat.OLDEST)
    # the profile and plan caches key on the transformers that runs (a side-by-side install: its own version)
    assert versions()["transformers"] == transformers.__version__


def test_an_older_transformers_is_one_clear_error() -> None:
    from uniap_lightning.errors import UniAPError

    compat.check_supported()  # the installed one is supported
    with pytest.raises(UniAPError, match=r"^transformers 4\.46\.3 is older than the oldest release the Hugging Face "
                                         r"adapters support \(4\.57\); install 'transformers>=4\.57,<6'"):
        compat.check_supported(Version("4.46.3"))


def test_gates_are_releases_between_the_oldest_and_the_next_major() -> None:
    for name in GATES:
        gate = Version(getattr(compat, name))
        assert Version(compat.OLDEST) < gate < Version("6"), name
        assert compat.at_least(str(gate), gate) and not compat.at_least(str(gate), Version(compat.OLDEST)), name


def test_causal_mask_is_causal_and_padding_on_this_release_and_the_other_call_does_not_fit() -> None:
    hidden, mask = _padded()
    out = compat.causal_mask(_config(), hidden, mask, torch.arange(5).unsqueeze(0))
    expected = torch.tril(torch.ones(5, 5, dtype=torch.bool)) & mask[:, None, None, :].bool()
    assert out.shape == (2, 1, 5, 5)
    assert torch.equal(_allowed(out), expected)
    with pytest.raises(TypeError):  # the other releases' arguments (input_embeds / cache_position / cache)
        compat.causal_mask(_config(), hidden, mask, version=_other(compat.CACHE_ARGUMENT))


def test_bidirectional_mask_is_the_padding_on_this_release_and_matches_the_other_branch() -> None:
    hidden, mask = _padded()
    out = compat.bidirectional_mask(_config(), hidden, mask)
    allowed = _allowed(out).expand(2, 1, 5, 5)
    assert torch.equal(allowed, mask[:, None, None, :].bool().expand(2, 1, 5, 5))
    if compat.at_least(compat.BIDIRECTIONAL_MASK):  # 5.x: the 4.x branch builds the same additive mask itself
        mine = compat.bidirectional_mask(_config(), hidden, mask, version=Version(compat.OLDEST))
        assert mine.dtype == hidden.dtype and torch.equal(mine.expand_as(out), out)  # (eager: additive too)
    else:  # 4.x: there is no create_bidirectional_mask to call
        with pytest.raises(ImportError):
            compat.bidirectional_mask(_config(), hidden, mask, version=NEWEST)
    assert compat.bidirectional_mask(_config(), hidden, None, version=Version(compat.OLDEST)) is None


def test_vit_blocks_are_where_this_release_keeps_them() -> None:
    import transformers as tr

    vit = tr.ViTModel(tr.ViTConfig(image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=2,
                                   num_attention_heads=2, intermediate_size=32))
    path, blocks = compat.vit_blocks(vit)
    assert vit.get_submodule(path) is blocks and len(blocks) == 2
    assert path == ("layers" if compat.at_least(compat.VISION_PROJECTIONS) else "encoder.layer")
    with pytest.raises(AttributeError):
        compat.vit_blocks(vit, _other(compat.VISION_PROJECTIONS))


def test_t5_decoder_block_runs_with_this_releases_arguments() -> None:
    """T5 as its default config ties the LM head to the embedding (and so, before 5.0, scales the decoder's
    output): the chain, its blocks called as the family calls them (the position bias given, the masks inside it
    before 5.15, ``cache_position`` before 5.4), gives the model's own logits on padded inputs."""
    import transformers as tr

    from uniap_lightning.adapters.families.t5 import t5_layers
    from uniap_lightning.runtime.payload import call_layer

    torch.manual_seed(0)
    model = tr.T5ForConditionalGeneration(tr.T5Config(
        vocab_size=16, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=4,
        relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=0, decoder_start_token_id=0,
        feed_forward_proj="relu")).eval()

    ids = torch.tensor([[3, 4, 5, 0], [6, 7, 8, 9]])
    mask = (ids != 0).long()
    labels = torch.tensor([[1, 2, 0], [3, 4, 5]])
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, decoder_input_ids=model._shift_right(labels),
                         decoder_attention_mask=(labels != 0).long()).logits
        x = {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": model._shift_right(labels),
             "decoder_attention_mask": (labels != 0).long()}
        for layer, _ in t5_layers(model):
            x = call_layer(layer, x)
    torch.testing.assert_close(x, expected)
    assert compat.t5_scales_decoder_outputs(model.config)  # (the default, tied, on every release)
    kwargs = compat.t5_block_kwargs(ids)
    if compat.at_least(compat.T5_BLOCK_CACHE_POSITION):
        assert kwargs == {}
    else:
        assert torch.equal(kwargs["cache_position"], torch.arange(4))
