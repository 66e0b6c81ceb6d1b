"""A transformer model described by its sizes (:class:`ModelSpec`: a ``conf/model`` entry, or one built in code),
checked as it is made: what the analytic model (:mod:`uniap_lightning.planner.analytic`, which re-exports these
names) and the roofline model price, and what `uniap train` builds. The layer names here are shared with the
runtime chains of the shipped models so that a plan made by `uniap plan` pins into them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from uniap_lightning.errors import UniAPError
from uniap_lightning.values import as_int, choice, flag, integer, number, text

#: the names of a token-embedding language model's layers, shared by the analytic model and the runtime chains of
#: the shipped models (``adapters.gpt.GPT.named_layers``), so that a plan made by `uniap plan` pins into them
EMBED_LAYER, BLOCK_LAYER, LM_HEAD_LAYER = "embed", "block", "lm_head"


def lm_layer_names(blocks: int) -> list[str]:
    """``embed, block0 .. block<blocks-1>, lm_head``: the layer names of :func:`analytic_profile` for a model with
    token embeddings, one run of blocks and an LM head (every model `uniap train` builds)."""
    return [EMBED_LAYER, *(f"{BLOCK_LAYER}{i}" for i in range(blocks)), LM_HEAD_LAYER]


DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


@dataclass(frozen=True)
class Segment:
    """A run of identical transformer blocks (Swin's stages or T5's decoder differ in shape)."""

    layers: int
    hidden: int
    heads: int
    ffn: int
    seq_len: int
    kv_heads: int | None = None
    window: int | None = None  # tokens each query attends to (windowed attention); None = full
    cross_attention: bool = False  # decoder block of an encoder-decoder (carries the encoder output too)
    name: str = BLOCK_LAYER


@dataclass(frozen=True)
class ModelSpec:
    """Hyper-parameters of a transformer (a Hydra ``model`` config)."""

    name: str
    layers: int = 0
    hidden: int = 0
    heads: int = 0
    ffn: int = 0
    seq_len: int = 0
    vocab: int = 0
    kv_heads: int | None = None
    gated_mlp: bool = False
    dtype: str = "bf16"
    embedding: str = "token"  # token | patch
    head: str = "lm"  # lm | classifier
    num_classes: int = 1000
    patch_size: int = 16
    image_size: int = 224
    channels: int = 3
    bias: bool = True
    flash_attention: bool = False  # fused attention keeps no s x s matrices for backward (Dao et al. 2022)
    #: dropout probability on the embedding and the attention and MLP outputs (the roofline model traces it)
    dropout: float = 0.0
    #: dropout probability on the attention probabilities (None: ``dropout``); unused with flash attention's
    #: pricing, whose kernel applies it in place
    attention_dropout: float | None = None
    #: fp32 models: matmuls on TF32 tensor cores (NGC containers, ``torch.backends.cuda.matmul.allow_tf32``)
    tf32: bool = False
    segments: tuple[Segment, ...] = ()
    #: mixture of experts in every block (0: dense MLPs): experts, experts per token, each expert's FFN size (0:
    #: ``ffn``), a shared expert every token runs (FFN size; 0: none), the capacity factor (None: dropless)
    experts: int = 0
    top_k: int = 1
    expert_ffn: int = 0
    shared_expert_ffn: int = 0
    capacity_factor: float | None = None
    family: str = ""
    source: str = ""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSpec:
        """A spec from a ``model`` config (YAML, overrides or a dict), every field checked (:meth:`validate`)."""
        if not isinstance(d, Mapping):
            raise UniAPError(f"a model config must be a mapping of fields, got {type(d).__name__}")
        d = {k: as_int(v) for k, v in d.items()}
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known, key=str)
        if unknown:
            raise UniAPError(f"model config '{d.get('name', '?')}' has unknown field(s) {unknown}; known: "
                             f"{sorted(known)}")
        if "name" not in d:
            raise UniAPError("model config needs a 'name'")
        segs = _segments(d.pop("segments", None), d["name"])
        spec = cls(**d, segments=segs)
        spec.validate()
        return spec

    def blocks(self) -> tuple[Segment, ...]:
        if self.segments:
            return self.segments
        return (Segment(self.layers, self.hidden, self.heads, self.ffn, self.seq_len, self.kv_heads),)

    def validate(self) -> None:
        """Refuse what no transformer has: wrong types, NaN, fractions, sizes out of range (:data:`LIMITS`), heads
        that do not divide hidden, kv_heads that do not divide heads. The one check `uniap plan`, `uniap train` and
        the Python API share."""
        text(self.name, "name", where="model config: ", empty=False)
        where = f"model '{self.name}': "
        choice(self.dtype, "dtype", DTYPE_BYTES, where=where)
        choice(self.embedding, "embedding", ("token", "patch"), where=where)
        choice(self.head, "head", ("lm", "classifier"), where=where)
        for key in ("dropout", "attention_dropout"):
            value = getattr(self, key)
            if key == "attention_dropout" and value is None:
                continue
            number(value, key, low=0, high=1, where=where, unit="a probability below 1")
            if value >= 1:
                raise UniAPError(f"{where}{key} must be below 1, got {value}")
        for key in ("gated_mlp", "bias", "flash_attention", "tf32"):
            flag(getattr(self, key), key, where=where)
        for key in ("family", "source"):
            text(getattr(self, key), key, where=where)
        if self.segments:  # the top-level shape is unused then; 0 means unset
            for key in ("layers", "hidden", "heads", "ffn", "seq_len"):
                integer(getattr(self, key), key, low=0, high=LIMITS[key], where=where)
        for j, seg in enumerate(self.blocks()):
            _check_block(seg, f"{where}segments[{j}]." if self.segments else where)
        total = sum(seg.layers for seg in self.blocks())
        if total > LIMITS["layers"]:
            raise UniAPError(f"{where}{total:,} layers in all: at most {LIMITS['layers']:,}")
        integer(self.vocab, "vocab", low=1 if self.embedding == "token" else 0, high=LIMITS["vocab"], where=where)
        integer(self.num_classes, "num_classes", low=1, high=LIMITS["num_classes"], where=where)
        integer(self.image_size, "image_size", low=1, high=LIMITS["image_size"], where=where)
        integer(self.patch_size, "patch_size", low=1, high=self.image_size, where=where, unit="at most image_size")
        integer(self.channels, "channels", low=1, high=LIMITS["channels"], where=where)
        self._validate_experts(where)

    def _validate_experts(self, where: str) -> None:
        E = integer(self.experts, "experts", low=0, high=LIMITS["experts"], where=where)
        for key in ("expert_ffn", "shared_expert_ffn"):
            integer(getattr(self, key), key, low=0, high=LIMITS["ffn"], where=where)
        if self.capacity_factor is not None:
            number(self.capacity_factor, "capacity_factor", low=0, high=1e3, low_open=True, where=where,
                   unit="or null: dropless")
        if E:
            integer(self.top_k, "top_k", low=1, high=E, where=where, unit="at most experts")
        elif self.expert_ffn or self.shared_expert_ffn or self.capacity_factor is not None or self.top_k != 1:
            raise UniAPError(f"{where}top_k, expert_ffn, shared_expert_ffn and capacity_factor describe a mixture "
                             "of experts: they need experts > 0")


#: the largest value each size may take: far above any published model (LLaMA-70B: 80 layers, hidden 8192), low
#: enough that a typo (layers=100000000) is refused at once instead of building a profile no solver finishes
LIMITS = {"layers": 100_000, "hidden": 2**20, "heads": 2**20, "ffn": 2**24, "seq_len": 2**24, "window": 2**24,
          "vocab": 2**24, "num_classes": 2**24, "image_size": 2**16, "channels": 2**12, "experts": 2**16}


def _segments(raw: Any, name: Any) -> tuple[Segment, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, (list, tuple)):
        raise UniAPError(f"model '{name}': segments must be a list of mappings, got {type(raw).__name__}")
    known = set(Segment.__dataclass_fields__)
    segs = []
    for j, s in enumerate(raw):
        if not isinstance(s, Mapping):
            raise UniAPError(f"model '{name}': segments[{j}] must be a mapping of fields, got {type(s).__name__}")
        unknown = sorted(set(s) - known, key=str)
        if unknown:
            raise UniAPError(f"model '{name}': segments[{j}] has unknown field(s) {unknown}; known: {sorted(known)}")
        missing = [k for k in ("layers", "hidden", "heads", "ffn", "seq_len") if k not in s]
        if missing:
            raise UniAPError(f"model '{name}': segments[{j}] lacks the field(s) {missing}")
        segs.append(Segment(**{k: as_int(v) for k, v in s.items()}))
    return tuple(segs)


def _check_block(seg: Segment, where: str) -> None:
    """One run of identical blocks: sizes in range, heads dividing hidden, kv_heads dividing heads."""
    for key in ("layers", "hidden", "ffn", "seq_len"):
        integer(getattr(seg, key), key, low=1, high=LIMITS[key], where=where)
    integer(seg.heads, "heads", low=1, high=seg.hidden, where=where, unit="at most hidden")
    if seg.hidden % seg.heads:
        raise UniAPError(f"{where}hidden={seg.hidden} is not divisible by heads={seg.heads}")
    if seg.kv_heads is not None:
        integer(seg.kv_heads, "kv_heads", low=1, high=seg.heads, where=where, unit="at most heads, or null")
        if seg.heads % seg.kv_heads:
            raise UniAPError(f"{where}heads={seg.heads} is not divisible by kv_heads={seg.kv_heads} (grouped-query "
                             f"attention shares each key/value head among heads/kv_heads query heads)")
    if seg.window is not None:
        integer(seg.window, "window", low=1, high=LIMITS["window"], where=where, unit="tokens, or null")
    flag(seg.cross_attention, "cross_attention", where=where)
    text(seg.name, "name", where=where)
