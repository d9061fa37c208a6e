"""One token's layer parts, each in one C call on the CPU (``csrc/quant_cpu.c``): the MoE block
(:func:`moe_token`, ``clover_moe_token``) and the Gated DeltaNet mixer (:func:`gdn_mixer_token`,
``clover_gdn_mixer_token``); and whole runs of decoder layers in one call (:func:`layer_runs`,
``clover_layers_token``: norms, mixer, MoE and residuals of every layer of the run, full attention included).

An AR step's MoE layer was ~25 small torch ops and 4-5 C calls: the router's product (MKL), its softmax and top-k,
the renormalization, the routed experts (``cpu_quant``), the shared expert's three products, its SiLU, its sigmoid
gate and the sums, each with a Python call, a dispatch and a fresh tensor; a Gated DeltaNet mixer was ~20 more
around its 4-5 C calls (the gates, the SiLUs, out_proj's column order). At Clover's real widths that overhead was
more than a third of a layer's time (docs/STATUS.md, "Per layer at depth"). The math is the modules' own, formula
by formula (:class:`engine.model.moe.SparseMoe`: softmax, the k largest, renormalized, SiLU-gated experts, the
shared expert times the sigmoid of its gate; :class:`engine.model.gdn.GatedDeltaNet`: sigmoid and softplus gates,
the same convolution and delta-rule kernels), and every quantized product rounds its activations to int8 blocks as
the separate calls do; the router's product, the exponentials and the SiLUs are C's own, so the results equal the
separate ops' within float32 rounding, not bit for bit (``tests/engine/test_cpu_token.py``).

Used for one token (the AR step, eager, float32, the CPU kernels built) when every weight has an in-place layout the
kernels read (each module's ``cpu_mat`` / ``cpu_mats``: GGUF blocks, the own cache's NF4 / INT8 / Q6_K; float32 rows
where the module keeps them so) and the expert bank is resident. :func:`set_enabled` switches all of them off (the
separate ops then run, as they do for every other pass); :func:`set_runs` only the runs (each layer's forward then
makes its one-call parts).

Runs: with the MoE and the mixer one call each, what was left of an AR step outside C was the Python between them
(the module calls, the norms and residual sums as torch ops, each call's checks and its fresh tensors): measured
with every C call a no-op, ~0.17 ms a layer at Clover's real widths, 2-3x that as it runs (docs/STATUS.md). A run
makes the same C calls from C, its arguments prepared once per cache (:class:`LayerRun`, kept beside the model by
what they point to and checked every step), so the Python cost is per step, not per layer.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Any

import torch
from torch import Tensor
from torch.nn.modules import module as nn_module

from clover_desk.engine.kernels import cpu_quant, gdn_kernels
from clover_desk.engine.kernels.torch_lanes import torch_lanes

# The kernels' mat_t: (ggml type or cpu_quant.NF4 / INT8, codes address, bytes between experts, bytes between rows,
# scales address (split formats), bytes between experts' scales, values per scale, value index of row 0)
Mat = tuple[int, int, int, int, int, int, int, int]

ENABLED = True


class _Mat(ctypes.Structure):
    _fields_ = [("qt", ctypes.c_int), ("w", ctypes.c_void_p), ("es", ctypes.c_int64), ("rs", ctypes.c_int64),
                ("s", ctypes.c_void_p), ("ses", ctypes.c_int64), ("bs", ctypes.c_int64), ("v0", ctypes.c_int64)]


def set_enabled(on: bool) -> bool:
    """Turn both one-call steps on or off for this process; returns the previous setting."""
    global ENABLED
    before, ENABLED = ENABLED, bool(on)
    return before


_BOUND: dict[tuple[int, str], Any] = {}  # (id(library), name) -> the bound function
_ARRAYS: dict[tuple[Mat, ...], Any] = {}  # the matrices of a layer -> their ctypes array (built once)


_ARGS = {  # each function's arguments: p a pointer, i an int64, c an int, f a float
    "clover_moe_token": "piiicpipipppppc",
    "clover_gdn_mixer_token": "pippppppipppfpppipiiiicc",
}
_CTYPES = {"p": ctypes.c_void_p, "i": ctypes.c_int64, "c": ctypes.c_int, "f": ctypes.c_float}


def _function(name: str = "clover_moe_token") -> Any:
    lib = cpu_quant.kernels().lib()
    fn = _BOUND.get((id(lib), name))
    if fn is None:
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [_CTYPES[a] for a in _ARGS[name]]
        _BOUND[(id(lib), name)] = fn
    return fn


def _array(mats: tuple[Mat, ...]) -> Any:
    arr = _ARRAYS.get(mats)
    if arr is None:
        if len(_ARRAYS) > 4096:  # models loaded and dropped in one process: never grow without bound
            _ARRAYS.clear()
        arr = _ARRAYS[mats] = (_Mat * len(mats))(*(_Mat(*m) for m in mats))
    return arr


def _f32_rows(linear: Any, rows: int, cols: int) -> Tensor | None:
    """A bias-free float32 linear's weight [rows, cols] when the kernel can read it as is, else None."""
    w = getattr(linear, "weight", None)
    ok = (isinstance(w, Tensor) and getattr(linear, "bias", None) is None and w.dtype == torch.float32
          and w.device.type == "cpu" and tuple(w.shape) == (rows, cols) and w.is_contiguous())
    return w if ok else None


def _one_token(x: Tensor) -> bool:
    """Whether a forward on x may take a one-call step: eager, switched on, one float32 CPU token [1, D], the kernels
    built."""
    return (not torch.compiler.is_compiling() and ENABLED and x.dim() == 2 and x.shape[0] == 1
            and x.dtype == torch.float32 and x.device.type == "cpu" and cpu_quant.usable())


def _mat(module: Any, **how: Any) -> Mat | None:
    """``module``'s weight as the kernels read it in place (its ``cpu_mat``), or None (none, or not readable)."""
    cpu_mat = getattr(module, "cpu_mat", None)
    return cpu_mat(**how) if cpu_mat is not None else None


def _moe_args(moe: Any, d: int) -> tuple[Any, ...] | None:
    """``moe``'s arguments of ``clover_moe_token`` after x and D, up to out (E, k, norm_topk, router, I, routed,
    Is, shared, sgate), or None where the call does not apply."""
    cfg, bank, shared = moe.config, moe.experts, moe.shared_expert
    e = cfg.num_experts
    router = _f32_rows(moe.gate, e, d)
    sgate = _f32_rows(moe.shared_expert_gate, 1, d)
    if (router is None or sgate is None or bank.needs_prepare or not hasattr(bank, "cpu_mats")
            or bank._forward_pre_hooks or bank._forward_hooks):  # hooked (a bench counting experts): its forward runs
        return None
    routed = bank.cpu_mats()
    parts = [_mat(m) for m in (shared.gate_proj, shared.up_proj, shared.down_proj)]
    if routed is None or None in parts:
        return None
    return (e, moe.top_k, int(bool(cfg.norm_topk_prob)), router.data_ptr(), bank.intermediate_size, _array(routed),
            shared.down_proj.in_features, _array(tuple(parts)), sgate.data_ptr())


def moe_token(moe: Any, x: Tensor, coreset: bool) -> Tensor | None:
    """``moe`` (a :class:`engine.model.moe.SparseMoe`) on one token x [1, D] in one C call -> [1, D] float32, with
    ``moe.last_topk_idx`` / ``last_topk_w`` set as its forward sets them; None where the call does not apply (then
    nothing is set). ``coreset``: the pass routes by block coreset (never one token's plain top-k)."""
    if coreset or not _one_token(x):
        return None
    d = x.shape[1]
    args = _moe_args(moe, d)
    if args is None:
        return None
    x = x.contiguous()
    out = torch.empty(1, d, dtype=torch.float32)
    idx = torch.empty(1, moe.top_k, dtype=torch.int64)
    w = torch.empty(1, moe.top_k, dtype=torch.float32)
    rc = _function("clover_moe_token")(x.data_ptr(), d, *args, out.data_ptr(), idx.data_ptr(), w.data_ptr(),
                                       torch.get_num_threads())
    cpu_quant._raise_for(rc, "moe_token")
    moe.last_topk_idx, moe.last_topk_w = idx, w
    return out


def _gdn_args(mixer: Any, d: int, st: tuple[Tensor, Tensor], write_cache: bool) -> tuple[Any, ...] | None:
    """``mixer``'s arguments of ``clover_gdn_mixer_token`` after x and D, up to out (proj, b_f32, a_f32, A_log,
    dt_bias, conv_w, K, conv_state, conv_out, norm_w, eps, state, state_out, outm, heads_hk), or None where the call
    does not apply."""
    mats = [_mat(mixer.in_proj_qkv), _mat(mixer.in_proj_z)]
    rows: list[Tensor | None] = []  # in_proj_b / in_proj_a as float32 rows where they have no quantized layout
    for m in (mixer.in_proj_b, mixer.in_proj_a):
        mats.append(_mat(m))
        rows.append(None if mats[-1] is not None else _f32_rows(m, m.out_features, d))
    if None in mats[:2] or any(mat is None and r is None for mat, r in zip(mats[2:], rows)):
        return None
    out_proj, hv, dv = mixer.out_proj, mixer.num_v_heads, mixer.dv
    heads = getattr(out_proj, "in_heads", None)  # GGUF's ssm_out: its input in the file's tiled head order
    out_mat = _mat(out_proj, heads_ok=True) if heads is not None else _mat(out_proj)
    if out_mat is None or (heads is not None and (heads[1] != hv or out_proj.in_features != hv * dv)):
        return None
    no_mat = (0, 0, 0, 0, 0, 0, 0, 0)  # the kernel reads the rows instead
    conv_state, state = st
    conv_w = mixer.conv1d.weight.view(mixer.conv_dim, mixer.kernel)
    return (_array(tuple(m or no_mat for m in mats)), *(None if r is None else r.data_ptr() for r in rows),
            mixer.A_log.data_ptr(), mixer.dt_bias.data_ptr(), conv_w.data_ptr(), mixer.kernel, conv_state.data_ptr(),
            conv_state.data_ptr() if write_cache else None, mixer.norm.weight.data_ptr(), mixer.norm.eps,
            state.data_ptr(), state.data_ptr() if write_cache else None, _array((out_mat,)), heads[0] if heads else 0)


def gdn_mixer_token(mixer: Any, x: Tensor, st: tuple[Tensor, Tensor], write_cache: bool) -> Tensor | None:
    """``mixer`` (a :class:`engine.model.gdn.GatedDeltaNet`) on one token x [1, D] in one C call -> [1, D] float32,
    its conv and recurrent states (``st``) updated in place when ``write_cache``; None where the call does not apply
    (then nothing is touched). The caller has checked what the separate C calls need (``gdn_kernels.cpu_token_ready``)."""
    if not _one_token(x):
        return None
    d = x.shape[1]
    args = _gdn_args(mixer, d, st, write_cache)
    if args is None:
        return None
    x = x.contiguous()
    out = torch.empty(1, d, dtype=torch.float32)
    rc = _function("clover_gdn_mixer_token")(x.data_ptr(), d, *args, out.data_ptr(), mixer.num_k_heads, mixer.num_v_heads,
                                             mixer.dk, mixer.dv, torch_lanes(), torch.get_num_threads())
    cpu_quant._raise_for(rc, "gdn_mixer_token")
    return out


# --- runs of whole decoder layers -----------------------------------------------------------------------------------

class _Layer(ctypes.Structure):  # the kernels' layer_t
    _fields_ = [(name, _CTYPES[kind]) for name, kind in (
        ("kind", "c"), ("norm1", "p"), ("eps1", "f"),
        ("proj", "p"), ("b_f32", "p"), ("a_f32", "p"), ("A_log", "p"), ("dt_bias", "p"), ("conv_w", "p"), ("K", "i"),
        ("conv_state", "p"), ("conv_out", "p"), ("gnorm_w", "p"), ("geps", "f"), ("state", "p"), ("state_out", "p"),
        ("outm", "p"), ("heads_hk", "i"), ("Hk", "i"), ("Hv", "i"), ("dk", "i"), ("dv", "i"),
        ("qkvo", "p"), ("q_norm", "p"), ("k_norm", "p"), ("qeps", "f"), ("keps", "f"), ("Hq", "i"), ("Hkv", "i"),
        ("hd", "i"), ("rd", "i"), ("max_len", "i"), ("kbuf", "p"), ("vbuf", "p"), ("write", "c"),
        ("norm2", "p"), ("eps2", "f"), ("E", "i"), ("k", "i"), ("norm_topk", "c"), ("router", "p"), ("I", "i"),
        ("routed", "p"), ("Is", "i"), ("shared", "p"), ("sgate", "p"))]


_ARGS["clover_layers_token"] = "pipiippppcc"
RUNS = True  # layer runs on (with ENABLED); off: each layer's own forward and its one-call parts


def set_runs(on: bool) -> bool:
    """Turn the layer runs (:func:`layer_runs`) on or off for this process; returns the previous setting."""
    global RUNS
    before, RUNS = RUNS, bool(on)
    return before


def _parts(layer: Any) -> tuple[Any, Any, Any]:
    """A decoder layer's (mixer, MoE block, expert bank), read from ``_modules`` (``nn.Module.__getattr__`` costs
    ~0.3 us a name, and this runs for every layer of every step)."""
    mods = layer._modules
    moe = mods["mlp"]
    return mods["self_attn"] if layer.is_full_attention else mods["linear_attn"], moe, moe._modules["experts"]


def _own_forward(layer: Any) -> bool:
    """Whether ``layer`` must run its own forward: it, its mixer, MoE block or bank hooked or compiled, or the bank
    fetching its experts first."""
    mixer, moe, bank = _parts(layer)
    return bool(bank.needs_prepare) or any(m._forward_hooks or m._forward_pre_hooks or m._compiled_call_impl is not None
                                           for m in (layer, mixer, moe, bank))


def _norm_ok(norm: Any, d: int) -> bool:
    """Whether an RMSNorm over d values is the C call in a layer's own forward too (``RMSNorm._one_call``)."""
    w = norm.weight
    return (w.dtype == torch.float32 and w.device.type == "cpu" and w.is_contiguous() and tuple(w.shape) == (d,)
            and torch_lanes() <= d <= 8192)


def _f32_buffer(t: Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


def _mixer_fields(layer: Any, h: Tensor, st: tuple[Tensor, Tensor], write_cache: bool,
                  rd: int) -> tuple[dict[str, Any], list[Any]] | None:
    """The layer_t fields of ``layer``'s token mixer (``rd`` rotary dims), with the ctypes arrays they point into, or
    None where a part of it would not be a C call in its own forward (or the attention has a bias, which the run
    does not add)."""
    d = h.shape[1]
    if not layer.is_full_attention:
        mixer = layer.linear_attn
        if not gdn_kernels.cpu_token_ready(h, *st, mixer.conv1d.weight, mixer.A_log, mixer.dt_bias, mixer.norm.weight):
            return None
        g = _gdn_args(mixer, d, st, write_cache)
        if g is None:
            return None
        names = ("proj", "b_f32", "a_f32", "A_log", "dt_bias", "conv_w", "K", "conv_state", "conv_out", "gnorm_w",
                 "geps", "state", "state_out", "outm", "heads_hk")
        fields = dict(zip(names, g))
        fields.update(kind=0, Hk=mixer.num_k_heads, Hv=mixer.num_v_heads, dk=mixer.dk, dv=mixer.dv)
        kept = [fields["proj"], fields["outm"]]
        fields["proj"], fields["outm"] = ctypes.addressof(kept[0]), ctypes.addressof(kept[1])
        return fields, kept
    attn = layer.self_attn
    kbuf, vbuf = st
    hd = attn.head_dim
    mats = tuple(_mat(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
    if (None in mats or any(getattr(m, "bias", None) is not None for m in (attn.q_proj, attn.k_proj, attn.v_proj,
                                                                           attn.o_proj))
            or not (_norm_ok(attn.q_norm, hd) and _norm_ok(attn.k_norm, hd) and _f32_buffer(kbuf) and _f32_buffer(vbuf))
            or kbuf.shape != vbuf.shape or tuple(kbuf.shape[::2]) != (attn.num_kv_heads, hd)
            or rd % 2 or not 2 <= rd <= hd):
        return None
    qkvo = _array(mats)  # type: ignore[arg-type]
    fields = dict(kind=1, qkvo=ctypes.addressof(qkvo), q_norm=attn.q_norm.weight.data_ptr(),
                  k_norm=attn.k_norm.weight.data_ptr(), qeps=attn.q_norm.eps, keps=attn.k_norm.eps,
                  Hq=attn.num_heads, Hkv=attn.num_kv_heads, hd=hd, rd=rd, max_len=kbuf.shape[1],
                  kbuf=kbuf.data_ptr(), vbuf=vbuf.data_ptr(), write=int(write_cache))
    return fields, [qkvo]


def _layer(layer: Any, h: Tensor, st: tuple[Tensor, Tensor], write_cache: bool, rd: int) -> tuple[_Layer, list[Any]] | None:
    """A decoder layer as the kernels' layer_t, with what it points into (kept alive by the caller), or None where it
    must run its own forward (the caller has checked :func:`_own_forward`)."""
    d, moe = h.shape[1], layer.mlp
    if not _norm_ok(layer.input_layernorm, d) or not _norm_ok(layer.post_attention_layernorm, d):
        return None
    mixed, m = _mixer_fields(layer, h, st, write_cache, rd), _moe_args(moe, d)
    if mixed is None or m is None:
        return None
    fields, kept = mixed
    e, k, norm_topk, router, inter, routed, inter_s, shared, sgate = m
    n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
    fields.update(norm1=n1.weight.data_ptr(), eps1=n1.eps, norm2=n2.weight.data_ptr(), eps2=n2.eps, E=e, k=k,
                  norm_topk=norm_topk, router=router, I=inter, routed=ctypes.addressof(routed), Is=inter_s,
                  shared=ctypes.addressof(shared), sgate=sgate)
    return _Layer(**fields), [*kept, routed, shared]


class LayerRun:
    """Consecutive decoder layers ``start`` .. ``end - 1`` of one model, for AR steps on one cache, in one C call
    (``clover_layers_token``): each layer's two norms, its token mixer, its MoE and both residual sums. The Gated
    DeltaNet layers make the same calls in the same order as their own forwards (so their bits); an attention
    layer's scores and softmax are C's (within float32 rounding of torch's SDPA). What it saves is the Python between
    the calls: at Clover's real widths ~0.17 ms a layer of pure overhead, 2-3x that as it runs (docs/STATUS.md)."""

    def __init__(self, model: Any, start: int, layers: list[tuple[_Layer, list[Any]]]) -> None:
        self.start, self.end = start, start + len(layers)
        self.moes = [model.layers[i].mlp for i in range(self.start, self.end)]
        self.k = sum(s.k for s, _ in layers)
        self._structs = (_Layer * len(layers))(*(s for s, _ in layers))
        self._keep = [kept for _, kept in layers]

    def __call__(self, h: Tensor, p: Any) -> Tensor:
        """h [1, D] float32 before layer ``start`` at position ``p.start_pos`` (``p.cos`` / ``p.sin`` its rotary
        angles) -> a new [1, D] after layer ``end - 1``; each layer's MoE routing set (``last_topk_idx`` /
        ``last_topk_w``) as its forward sets it."""
        h = h.contiguous().clone()
        cos, sin = p.cos.contiguous(), p.sin.contiguous()
        idx = torch.empty(self.k, dtype=torch.int64)
        w = torch.empty(self.k, dtype=torch.float32)
        rc = _function("clover_layers_token")(self._structs, self.end - self.start, h.data_ptr(), h.shape[1],
                                              p.start_pos, cos.data_ptr(), sin.data_ptr(), idx.data_ptr(),
                                              w.data_ptr(), torch_lanes(), torch.get_num_threads())
        cpu_quant._raise_for(rc, "layers_token")
        at = 0
        for moe in self.moes:
            moe.last_topk_idx, moe.last_topk_w = idx[at : at + moe.top_k][None], w[at : at + moe.top_k][None]
            at += moe.top_k
        return h


class _Kept:
    """One cache's runs for one model: the runs, weak references to what they were built from (the cache, its
    tensors, each layer and its mixer, MoE block and expert bank), and the storages of every layer's weights
    (pinned, so that no pointer a run holds can outlive its memory)."""

    def __init__(self, runs: dict[int, LayerRun], watched: list[Any], pinned: list[Tensor]) -> None:
        self.runs, self.pinned = runs, pinned
        self.refs = [weakref.ref(o) for o in watched]

    def alive(self) -> bool:
        """Whether everything watched is still alive (so an equal key names the very same objects)."""
        return all(r() is not None for r in self.refs)


# each model's runs by key, beside the model (not in it: a deep copy of the model must not copy ctypes pointers)
_KEPT: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], _Kept]] = weakref.WeakKeyDictionary()


def kept_runs(model: Any) -> dict[tuple[Any, ...], dict[int, LayerRun]]:
    """The runs built for ``model`` so far, by key (for tests and benches)."""
    return {k: v.runs for k, v in _KEPT.get(model, {}).items()}


def forget(model: Any) -> None:
    """Drop ``model``'s runs: for code that replaces a layer's weights in place after AR steps have run (a run
    reads the weights it was built from until then; replacing a layer's mixer, MoE block or bank is noticed)."""
    _KEPT.pop(model, None)


def _watch(model: Any, cache: Any, write_cache: bool) -> tuple[tuple[Any, ...], list[Any], list[bool]]:
    """What a step's runs depend on: (a key: the write switch, whether each layer must run its own forward and the
    ids of the watched objects; the watched objects: the cache, its tensors, each layer and its mixer, MoE block
    and bank; per layer, whether it must run its own forward: :func:`_own_forward`, or any global forward hook
    set). Live objects have distinct ids, so while the watched objects live (:meth:`_Kept.alive`) an equal key means
    the same objects."""
    watched: list[Any] = [cache]
    hooked_all = bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)
    own = []
    for i, layer in enumerate(model.layers._modules.values()):
        first, second = cache.layer(i)
        watched += (first, second, layer, *_parts(layer))
        own.append(hooked_all or _own_forward(layer))
    return (int(write_cache), *own, *map(id, watched)), watched, own


def layer_runs(model: Any, h: Tensor, p: Any) -> dict[int, LayerRun]:
    """The runs of consecutive decoder layers that this pass of ``model`` takes as one C call each, by first layer:
    an eager causal AR step (one float32 CPU token, a cache, rotary angles in float32) with :data:`ENABLED` and
    :data:`RUNS`; empty otherwise. Built on a cache's first step and kept beside the model for the next ones, by
    what they depend on (:func:`_watch`, checked every step)."""
    if (torch.compiler.is_compiling() or not RUNS or p.cache is None or p.block_size is not None or p.by_rows
            or p.pos is not None or p.attn_mask is not None or not _one_token(h) or p.cos is None
            or p.cos.dtype != torch.float32):
        return {}
    key, watched, own = _watch(model, p.cache, p.write_cache)
    kept = _KEPT.get(model)
    if kept is None:
        kept = _KEPT[model] = {}
    entry = kept.get(key)
    if entry is not None and entry.alive():
        return entry.runs
    runs, current = {}, []
    for i, layer in enumerate(model.layers):
        built = None if own[i] else _layer(layer, h, p.cache.layer(i), p.write_cache, p.cos.shape[-1])
        if built is not None:
            current.append(built)
        if current and (built is None or i == len(model.layers) - 1):
            start = i - len(current) + (built is not None)
            runs[start] = LayerRun(model, start, current)
            current = []
    if len(kept) > 8:  # caches come and go: never grow without bound
        kept.clear()
    pinned = [t.detach() for layer in model.layers for t in (*layer.parameters(), *layer.buffers())]
    kept[key] = _Kept(runs, watched, pinned)
    return runs
