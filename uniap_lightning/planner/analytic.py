"""Analytic per-layer profiles of transformer models, for planning clusters you don't own.

Sources of the formulas (per sample, sequence length ``s``, hidden ``h``, heads ``a``, FFN size ``f``, vocab ``V``):

* FLOPs (2 per multiply-accumulate), Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", SC'21, Sec. 5.1: a block does ``24 s h^2 + 4 s^2 h`` forward FLOPs with
  ``f = 4h``. In general: QKV ``2 s h (h + 2 h_kv)``, scores and context ``4 s s_att h``, output projection
  ``2 s h^2``, MLP ``4 s h f`` (``6 s h f`` for gated/SwiGLU MLPs), where ``s_att`` is ``s`` (or the window
  size for windowed attention, Liu et al., Swin, ICCV'21) and a decoder block with cross attention adds a
  second attention. Backward costs 2x forward (same source). LM head: ``2 s h V``.
* Activations saved for backward, Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
  Models", MLSys'23, Sec. 4.1: ``s h (34 + 5 a s / h)`` bytes with 16-bit activations, of which
  ``s h (24 + 5 a s / h)`` is split by tensor parallelism (``10 s h`` is not, without sequence parallelism).
  We generalise the MLP share (``19 s h`` at ``f = 4h``) to ``3 s h + 4 s f`` (``3 s h + 6 s f`` gated) and
  scale by ``dtype_bytes / 2``. With ``flash_attention`` (Dao et al., NeurIPS'22) the ``5 a s^2`` score tensors
  are not stored; only the softmax statistics (``4 a s`` bytes) are.
* Parameters: attention ``h (h + 2 h_kv) + h^2`` (+ biases), MLP ``2 h f`` (``3 h f`` gated), norms.
* Time: ``FLOPs / (peak * efficiency)`` of the cluster's device.
* Mixture of experts (``experts`` E > 0; Shazeer et al. 2017, Fedus et al. 2021; Mixtral, Qwen2-MoE): the MLP is
  a router (``h E`` parameters, ``2 s h E`` FLOPs), E experts of FFN size ``f_e = expert_ffn`` (parameters ``E``
  times one MLP's: the block's ``expert_params``), of which each token runs ``top_k`` = k (FLOPs ``k`` times one
  MLP's), and an optional shared expert of FFN size ``shared_expert_ffn`` run by every token (Qwen2-MoE, with its
  ``h``-parameter sigmoid gate). Activations: ``3 s h`` as above, ``k (2 s h + 4 s f_e)`` (``6 s f_e`` gated) for
  the routed copies (the dispatched input and the expert's intermediates), the shared expert like a dense MLP, and
  the router's fp32 probabilities (``4 s E`` bytes).
"""

from __future__ import annotations

from collections.abc import Callable

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.cluster import Cluster
# the model description (its fields and checks) is a module of its own; imported from here as before
from uniap_lightning.planner.model_spec import (BLOCK_LAYER, DTYPE_BYTES, EMBED_LAYER, LIMITS, LM_HEAD_LAYER,
                                                ModelSpec, Segment, lm_layer_names)
from uniap_lightning.planner.profile import LayerProfile, ModelProfile

__all__ = ["BLOCK_LAYER", "DTYPE_BYTES", "EMBED_LAYER", "LIMITS", "LM_HEAD_LAYER", "ModelSpec", "RooflinePricer",
           "Segment", "analytic_profile", "block_profile", "config_fingerprint", "lm_layer_names", "scale_for"]

#: prices a model on a cluster whose ``compute_model`` is ``"roofline"``: ``(spec, cluster, the flat profile) ->
#: the profile`` with each layer traced as operations and priced on the catalogue device. Tracing needs torch, so
#: it lives above the planner (:func:`uniap_lightning.profiling.roofline.roofline_profile`; torch-free to import:
#: :func:`uniap_lightning.profiling.pricing.roofline`) and is passed in
RooflinePricer = Callable[[ModelSpec, Cluster, ModelProfile], ModelProfile]

#: tensor-parallel degrees a layer may take (those dividing its head and size counts)
POW2 = (1, 2, 4, 8, 16, 32, 64)


def _tp_degrees(*counts: int) -> tuple[int, ...]:
    return tuple(t for t in POW2 if all(c % t == 0 for c in counts))


def scale_for(spec: ModelSpec) -> float:
    return DTYPE_BYTES[spec.dtype] / 2


def block_profile(seg: Segment, spec: ModelSpec, flops_per_s: float, index: int) -> LayerProfile:
    s, h, a, f = seg.seq_len, seg.hidden, seg.heads, seg.ffn
    kv = seg.kv_heads or a
    h_kv = h // a * kv
    s_att = min(seg.window or s, s)
    nbytes = DTYPE_BYTES[spec.dtype]
    attn_flops = 2 * s * h * (h + 2 * h_kv) + 4 * s * s_att * h + 2 * s * h * h
    n_attn = 2 if seg.cross_attention else 1
    attn_params = h * (h + 2 * h_kv) + h * h + (4 * h if spec.bias else 0)
    mlp_params, mlp_flops, mlp_act, expert_params, tp_sizes = _mlp(spec, s, h, f)
    fwd = n_attn * attn_flops + mlp_flops
    params = n_attn * attn_params + mlp_params + (n_attn + 1) * 2 * h
    # Korthikanti: 11 s h + 5 a s s_att; with fused (flash) attention the a s s_att score/softmax/dropout
    # tensors are recomputed in backward and only the softmax statistics (4 bytes x a x s) are kept.
    attn_act = 11 * s * h + (4 * a * s / scale_for(spec) if spec.flash_attention else 5 * a * s * s_att)
    act_units = n_attn * attn_act + mlp_act + (n_attn + 1) * 2 * s * h
    split_units = act_units - n_attn * 4 * s * h - 2 * s * h  # inputs of the column-parallel matmuls + norms stay
    scale = nbytes / 2
    carried = 2 if seg.cross_attention else 1  # a decoder block also passes the encoder output on
    return LayerProfile(
        name=f"{seg.name}{index}",
        forward_s=fwd / flops_per_s,
        backward_s=2 * fwd / flops_per_s,
        params=int(params),
        activation_bytes=float(act_units * scale),
        output_bytes=float(carried * s * h * nbytes),
        tp_degrees=_tp_degrees(a, kv, *tp_sizes),
        tp_allreduces=2 * n_attn,
        activation_tp_fraction=max(0.0, min(1.0, split_units / act_units)),
        # the sequence dimension: a block's attention splits over cp by heads (Ulysses) or blocks (ring); a
        # decoder block with cross attention also carries the encoder's sequence, which this model does not split
        sequence_length=None if seg.cross_attention else s,
        attention_heads=a,
        kv_heads=kv if kv != a else None,
        sequence_parallel=True,
        experts=spec.experts,
        top_k=spec.top_k if spec.experts else 1,
        expert_params=int(expert_params),
        capacity_factor=spec.capacity_factor if spec.experts else None,
    )


def _mlp(spec: ModelSpec, s: int, h: int, f: int) -> tuple[float, float, float, float, tuple[int, ...]]:
    """A block's MLP: ``(params, forward FLOPs, activation units, expert params, FFN sizes TP must divide)``, dense
    or a mixture of experts (module docstring)."""
    mats = 3 if spec.gated_mlp else 2
    per_f = 6 if spec.gated_mlp else 4  # activation units per FFN unit and token

    def dense(ffn: int) -> tuple[float, float]:  # params, FLOPs of one MLP of FFN size ``ffn``
        return mats * h * ffn + (ffn + h if spec.bias else 0), 2 * mats * s * h * ffn

    if not spec.experts:
        p, fl = dense(f)
        return p, fl, 3 * s * h + per_f * s * f, 0, (f,)
    E, k, fe, fsh = spec.experts, spec.top_k, spec.expert_ffn or f, spec.shared_expert_ffn
    pe, fle = dense(fe)
    params, flops = h * E + E * pe, 2 * s * h * E + k * fle
    act = 3 * s * h + k * (2 * s * h + per_f * s * fe) + 4 * s * E / scale_for(spec)
    sizes: tuple[int, ...] = (fe,)
    if fsh:
        psh, flsh = dense(fsh)
        params, flops = params + psh + h, flops + flsh + 2 * s * h  # and its sigmoid gate
        act += 2 * s * h + per_f * s * fsh
        sizes = (fe, fsh)
    return params, flops, act, E * pe, sizes


def analytic_profile(spec: ModelSpec, cluster: Cluster, roofline: RooflinePricer | None = None) -> ModelProfile:
    """The chain ``embedding, blocks..., head`` with analytic costs on ``cluster``'s device: FLOPs over the flat
    ``peak x efficiency``, or, for a cluster whose ``compute_model`` is ``"roofline"``, each layer traced as
    operations and priced on the catalogue device by ``roofline`` (:data:`RooflinePricer`; the layers above the
    planner pass :func:`uniap_lightning.profiling.pricing.roofline`, as ``uniap_lightning.build_problem`` and
    ``uniap plan`` do); a roofline cluster without one is refused, naming both ways out."""
    profile = _flat_profile(spec, cluster)
    if cluster.compute_model != "roofline":
        return profile
    if roofline is None:
        raise UniAPError(
            f"cluster '{cluster.name}' prices layers with the roofline model (compute_model: roofline, device "
            f"{cluster.device}), which traces each layer with torch above the planner: pass "
            "roofline=uniap_lightning.profiling.pricing.roofline (or use uniap_lightning.build_problem, which "
            "does), or give the cluster peak_tflops and efficiency with compute_model: flat"
        )
    return roofline(spec, cluster, profile)


def config_fingerprint(spec: ModelSpec) -> str:
    """The ``model_fingerprint`` of the plans `uniap plan` makes for ``spec`` on any cluster (names, parameters and
    output sizes: no timing enters it)."""
    nominal = Cluster(name="fingerprint", nodes=1, devices_per_node=1, memory_gib=1.0, peak_tflops=1.0)
    return _flat_profile(spec, nominal).fingerprint()


def _flat_profile(spec: ModelSpec, cluster: Cluster) -> ModelProfile:
    flops = cluster.flops_per_s
    nbytes = DTYPE_BYTES[spec.dtype]
    first, last = spec.blocks()[0], spec.blocks()[-1]
    s0, h0 = first.seq_len, first.hidden
    layers: list[LayerProfile] = []
    if spec.embedding == "token":
        emb_params = spec.vocab * h0 + (s0 * h0 if spec.family in ("gpt2", "bert", "t5") else 0)
        layers.append(
            LayerProfile(
                name=EMBED_LAYER,
                forward_s=(2 * s0 * h0) / flops,  # gather + add: memory bound, tiny
                backward_s=(4 * s0 * h0) / flops,
                params=emb_params,
                activation_bytes=float(s0 * h0 * nbytes),
                output_bytes=float(s0 * h0 * nbytes),
                tp_degrees=_tp_degrees(spec.vocab if spec.vocab % 8 == 0 else 8, h0),
                tp_allreduces=1,
                sequence_length=s0,  # token by token (positions offset by the shard's start)
            )
        )
    else:
        patch_dim = spec.channels * spec.patch_size**2
        fwd = 2 * s0 * patch_dim * h0
        layers.append(
            LayerProfile(
                name="patch_embed",
                forward_s=fwd / flops,
                backward_s=2 * fwd / flops,
                params=patch_dim * h0 + h0 + s0 * h0,
                activation_bytes=float(s0 * patch_dim * nbytes),
                output_bytes=float(s0 * h0 * nbytes),
                tp_degrees=(1,),
                tp_allreduces=0,
                sequence_length=s0,  # patch by patch
            )
        )
    index = 0
    prev_h = h0
    for seg in spec.blocks():
        for _ in range(seg.layers):
            lp = block_profile(seg, spec, flops, index)
            if seg.hidden != prev_h:  # Swin's patch merging folds into the first block of a stage
                merge = 4 * prev_h * seg.hidden
                lp = LayerProfile(
                    **{
                        **lp.__dict__,
                        "params": lp.params + merge,
                        "forward_s": lp.forward_s + 2 * seg.seq_len * merge / flops,
                        "backward_s": lp.backward_s + 4 * seg.seq_len * merge / flops,
                    }
                )
                prev_h = seg.hidden
            layers.append(lp)
            index += 1
    s1, h1 = last.seq_len, last.hidden
    if spec.head == "lm":
        fwd = 2 * s1 * h1 * spec.vocab
        layers.append(
            LayerProfile(
                name=LM_HEAD_LAYER,
                forward_s=fwd / flops,
                backward_s=2 * fwd / flops,
                params=spec.vocab * h1 + 2 * h1,
                # logits in the compute dtype plus fp32 softmax for the loss
                activation_bytes=float(s1 * h1 * nbytes + s1 * spec.vocab * (nbytes + 4)),
                output_bytes=4.0,
                tp_degrees=_tp_degrees(spec.vocab if spec.vocab % 8 == 0 else 8, h1),
                tp_allreduces=1,
                activation_tp_fraction=0.9,
                sequence_length=s1,  # logits and the loss token by token
            )
        )
    else:
        fwd = 2 * h1 * spec.num_classes + 2 * s1 * h1
        layers.append(
            LayerProfile(
                name="head",
                forward_s=fwd / flops,
                backward_s=2 * fwd / flops,
                params=h1 * spec.num_classes + spec.num_classes + 2 * h1,
                activation_bytes=float(s1 * h1 * nbytes),
                output_bytes=4.0,
                tp_degrees=(1,),
                tp_allreduces=0,
            )
        )
    return ModelProfile(
        model=spec.name,
        layers=layers,
        source="analytic",
        device=cluster.device or cluster.name,
        meta={"dtype": spec.dtype, "params": sum(lp.params for lp in layers)},
    )
