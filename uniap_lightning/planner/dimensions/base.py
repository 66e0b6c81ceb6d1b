"""What one dimension of the per-layer decision declares (:class:`Dimension`, :class:`Field`, :class:`Column`)
and what its candidate options are given (:class:`Slot`). Torch-free; imports nothing from the planner above it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner import fields as F

if TYPE_CHECKING:
    from uniap_lightning.planner.cluster import Cluster
    from uniap_lightning.planner.problem import TrainingConfig
    from uniap_lightning.planner.profile import LayerProfile

#: a field without a default (the decision record's ``dp`` and ``tp``: a plan layer must name them)
REQUIRED: Any = object()


@dataclass(frozen=True)
class Slot:
    """What a layer's candidate options depend on besides the choices made before: the layer, the stage's ``n``
    devices, the cluster, the micro-batch size, the compression methods the solver may choose, whether the
    sequence dimension (context and sequence parallelism) is open, and what the user allowed each opt-in dimension
    (:class:`OptIn`), as ``(option, allowed values)`` pairs: read with :meth:`allowed`."""

    layer: LayerProfile
    n: int
    cluster: Cluster
    micro_batch: int
    compression: tuple[str, ...] = ("none",)
    sequence: bool = True
    opt_ins: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def allowed(self, option: str) -> tuple[str, ...]:
        """The values the user allowed the opt-in ``option`` (none: off)."""
        return dict(self.opt_ins).get(option, ())


@dataclass(frozen=True)
class OptIn:
    """A per-job permission a dimension asks for: values it offers only where the user allowed them (they change
    numerics), as ``UniAPStrategy(<option>=...)`` and ``uniap plan <option>=``. The setup, the plan cache, the
    command line and the problem (``Problem.opt_ins``) carry every dimension's permissions as one mapping (option
    name -> the allowed values, :func:`~uniap_lightning.planner.dimensions.opt_ins`), and the cost model checks a
    pinned plan through the hooks below, so a new opt-in dimension threads nothing and is named nowhere else.

    ``option``: the keyword, and the key of the mapping (:meth:`Slot.allowed` reads it; ``strategies_for`` takes
    it as a keyword);
    ``allowed(value, where)``: the user's value as the tuple of allowed per-layer values (``()``: off), refusing
    a bad one in one line naming ``where`` (also given what it returns: idempotent); ``off``: the values that mean
    "not given" (a pinned plan refuses others); ``pinned``: what a pinned plan has of its own instead (said in that
    refusal: "precision per layer");
    ``values``: every per-layer value it may offer once allowed (a pinned plan's layers are checked against the
    candidates with all of them allowed); ``check_plan(plan, cluster)``: a pinned plan's check against the cluster
    it is to run on (one-line refusal), or None; ``why_not(layer, s, cluster)``: why strategy ``s``'s value of
    this dimension is not offered for ``layer`` on ``cluster`` (the refusal's reason, in words naming the field),
    None where it is, or no hook;
    ``type``, ``help``: the option's value type (``None`` also taken: off) and the line ``uniap plan --help``
    prints for it (the planning commands' schema declares the option from these)."""

    option: str
    allowed: Callable[[Any, str], tuple[str, ...]]
    off: tuple[Any, ...]
    pinned: str
    check_plan: Callable[[Any, Any], None] | None = None
    values: tuple[str, ...] = ()
    why_not: Callable[[Any, Any, Any], str | None] | None = None
    type: type = str
    help: str = ""


#: a field's candidate values, given the slot and the values chosen for the fields enumerated before it
Options = Callable[[Slot, Mapping[str, Any]], Iterable[Any]]


def _read_integer(value: Any, where: str) -> int:
    return F.integer(value, where, low=1, high=F.MAX_COUNT)


#: the plan-JSON reader of each field type (the format's JSON types: a count, a name, a flag)
JSON_READERS: dict[type, Callable[[Any, str], Any]] = {int: _read_integer, str: F.string, bool: F.boolean}


@dataclass(frozen=True)
class Field:
    """One field of the decision record: its name, type and default; ``check`` (or None): the value's own rule
    (its vocabulary), raising :class:`UniAPError` with the message it returns; ``since``: the plan format version
    that added it (an older file reads the default, or ``legacy(layer_object, where, values_read_so_far)``;
    absent from a newer file: the default, unless required);
    ``options``: its candidate values (see :data:`Options`)."""

    name: str
    type: type
    default: Any
    options: Options
    check: Callable[[Any], str | None] | None = None
    since: int = 1
    legacy: Callable[[dict, str, Mapping[str, Any]], Any] | None = None
    #: a plan layer must name it even though the record has a default (``dp_mode`` since format 2)
    required_in_plan: bool = False

    def validate(self, value: Any, where: str) -> None:
        message = None if self.check is None else self.check(value)
        if message:
            raise UniAPError(f"{where}: {message}")

    def read(self, x: dict, where: str, version: int, values: Mapping[str, Any]) -> Any:
        """The field from a plan layer's JSON object ``x`` written in format ``version``: required where it has
        no default, else its default when absent; before ``since``, the legacy reading or the default."""
        if version < self.since:
            return self.default if self.legacy is None else self.legacy(x, where, values)
        required = self.default is REQUIRED or self.required_in_plan
        raw = F.required(x, self.name, where) if required else x.get(self.name, self.default)
        return JSON_READERS[self.type](raw, f"{where}: {self.name}")


def one_of(name: str, vocabulary: tuple[str, ...]) -> Callable[[Any], str | None]:
    """A check: the value is one of ``vocabulary``."""
    return lambda v: None if v in vocabulary else f"{name}={v!r} must be one of {vocabulary}"


def flag(name: str) -> Callable[[Any], str | None]:
    """A check: the value is a real boolean."""
    return lambda v: None if isinstance(v, bool) else f"{name} must be true or false, got {v!r}"


@dataclass(frozen=True)
class Column:
    """A column of the report's per-layer table: its header, the cell of a strategy, and ``shown`` (or None:
    always): the column appears only where some layer's strategy makes it true. ``explain`` (or None: absent):
    the cell in ``explain``'s per-layer table, left-justified there where ``explain_left`` (a name, not a flag)."""

    header: str
    cell: Callable[[Any], str]
    shown: Callable[[Any], bool] | None = None
    explain: Callable[[Any], str] | None = None
    explain_left: bool = False


@dataclass
class LayerTerms:
    """One layer's terms under one strategy while :func:`~uniap_lightning.planner.cost.layer.layer_cost` prices it,
    as a dimension's cost hooks see them: what it depends on (the layer, the strategy ``s``, the cluster, the
    training's bytes per parameter, ``pricing``: micro-batch, stage size, accumulation), what the cost model has
    derived (``d`` ranks holding the same weights, the state ``mode`` they hold it in, ``tokens`` per rank in
    samples' worth) and the terms so far, which a hook adjusts in place. Seconds and bytes, as
    :class:`~uniap_lightning.planner.cost.layer.LayerCost`:

    - ``compute``: seconds per micro-batch of the layer's forward and backward on a rank (set at ``price_compute``,
      before anything reads it: the backward split and recomputation follow a change);
    - ``shared``: the parameters per rank (after tensor parallelism) that the ``d`` replicas hold alike (the
      experts' share apart); ``gather_s(bytes)``: one all-gather of ``bytes`` per rank over those replicas;
      ``state_comm`` (per micro-batch: ZeRO-3's gathers), ``sync`` (per step), ``static`` and ``transient``
      (bytes) of that state (set at ``price_state``, before the experts' own state is added);
    - ``comm`` (per micro-batch, beside compute), ``act`` (bytes per micro-batch in flight) and ``transient``
      after the activations and recomputation (at ``price_activations``, before NCCL's buffers join the
      transient);
    - ``notes``: what a dimension's hook keeps for its later hooks (by dimension name)."""

    layer: LayerProfile
    s: Any
    cluster: Cluster
    training: TrainingConfig
    pricing: Any
    d: int
    mode: str
    tokens: float
    compute: float
    shared: float = 0.0
    gather_s: Callable[[float], float] = field(default=lambda _bytes: 0.0)  # set with ``shared``
    state_comm: float = 0.0
    sync: float = 0.0
    static: float = 0.0
    comm: float = 0.0
    act: float = 0.0
    transient: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)


#: a dimension's cost hook: adjusts the :class:`LayerTerms` in place
Price = Callable[[LayerTerms], None]
#: the points of the layer's pricing where the hooks run, in order (each a :class:`Dimension` field)
COST_PHASES = ("price_compute", "price_state", "price_activations")


def _nothing(_s: Any) -> str:
    return ""


def _no_change(_values: Mapping[str, Any]) -> dict[str, Any]:
    return {}


def _no_rule(_s: Any, _where: str, _experts: int | None) -> None:
    return None


@dataclass(frozen=True)
class Dimension:
    """One dimension of the per-layer decision, declared in one object by its module.

    ``fields``: its fields of the decision record; ``canonical(values)``: the values it resets given the record's
    values (what ``Strategy.of`` does for it: say, a rule that means nothing without replicas); ``grid``: its
    fragment of the label's device grid (``dp2``, ``cp2u``, ``tp4``; "" for none), ``suffix``: its ``+...``
    fragment after the grid; ``rules(s, where, experts)``: its checks that relate fields (after every field's own
    check), raising :class:`UniAPError`; ``columns``: its columns in the report (placed by the registry's
    order).

    Its cost terms, each optional (:data:`Price`, registry order within a phase; see :class:`LayerTerms` for what
    each sees): ``price_compute`` changes the layer's compute (a cheaper matmul precision), ``price_state`` its
    state's bytes, gathers and step (where its weights, gradients and optimizer state live), ``price_activations``
    its activations and what moving them costs (offload to host). A dimension that changes no term declares none;
    the cost model calls them and names no dimension."""

    name: str
    fields: tuple[Field, ...]
    opt_in: OptIn | None = None
    canonical: Callable[[Mapping[str, Any]], dict[str, Any]] = _no_change
    grid: Callable[[Any], str] = _nothing
    suffix: Callable[[Any], str] = _nothing
    rules: Callable[[Any, str, int | None], None] = _no_rule
    columns: tuple[Column, ...] = field(default=())
    price_compute: Price | None = None
    price_state: Price | None = None
    price_activations: Price | None = None
