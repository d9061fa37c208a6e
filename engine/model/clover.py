"""Clover-35B-A3B / Qwen3.5-MoE text model in plain PyTorch: the decoder layer and :class:`CloverModel` (the
forward, the cache it writes, block mode); the layers themselves are in :mod:`engine.model.attention`,
:mod:`engine.model.gdn` (Gated DeltaNet and the delta rule), :mod:`engine.model.moe`, :mod:`engine.model.cache`
(ModelCache, one pass's facts) and :mod:`engine.model.layers` (RMSNorm, Linear).

Math: the Qwen3.5-MoE causal model (gated attention, Gated DeltaNet, MoE with a shared expert) and Clover's block
mode; every alternative reading of Clover's extras is a config switch (engine/model/config.py).

Letters used in shape comments:
  T tokens in this pass, P committed prefix length (cache.length), S = P + T keys, D hidden size, V vocab,
  Hq / Hkv attention query / key-value heads, hd attention head dim, rd rotary dims,
  Hk / Hv GDN key / value heads, dk / dv GDN key / value head dims, C conv channels (2*Hk*dk + Hv*dv),
  K conv kernel, Kr right-conv taps, B block size (also the GDN chunk length in block mode), n chunks / blocks,
  E experts, k experts per token, I expert intermediate size.

The model runs one sequence at a time: ``ids`` is a 1-D LongTensor. See :meth:`CloverModel.forward`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor, nn

from clover_desk.engine.errors import PromptError
from clover_desk.engine.kernels.cpu_token import layer_runs, moe_token
from clover_desk.engine.model.attention import ATTENTION_ROWS, Attention, rope_cos_sin
from clover_desk.engine.model.cache import ModelCache, PassContext
from clover_desk.engine.model.config import CloverConfig
from clover_desk.engine.model.gdn import GDN_CHUNK, GatedDeltaNet
from clover_desk.engine.model.layers import Linear, RMSNorm
from clover_desk.engine.model.moe import SparseMoe
from clover_desk.engine.weights.formats import FP32_PARAMS

log = logging.getLogger(__name__)


class DecoderLayer(nn.Module):
    def __init__(self, config: CloverConfig, layer_idx: int, clover_extras: bool) -> None:
        super().__init__()
        self.is_full_attention = config.is_full_attention(layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.is_full_attention:
            self.self_attn = Attention(config, layer_idx)
        else:
            self.linear_attn = GatedDeltaNet(config, layer_idx, clover_extras)
        self.mlp = SparseMoe(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: Tensor, p: PassContext, st: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """``st``: this layer's cache tensors (``ModelCache.layer``), None without a cache."""
        h, x = self.mixed(h, p, st)
        one = moe_token(self.mlp, x, p.coreset and p.block_size is not None)  # an AR step on the CPU: one C call
        if one is not None:
            return h + one.to(h.dtype)
        w, idx = self.mlp.route(x, p)
        return self.back(h, x, self.mlp.routed(x, w, idx))

    def mixed(self, h: Tensor, p: PassContext, st: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """The token mixer and its residual, then the MoE input norm: (h [T, D] after the mixer, x [T, D])."""
        mixer = self.self_attn if self.is_full_attention else self.linear_attn
        h = h + mixer(self.input_layernorm(h), p, st)
        return h, self.post_attention_layernorm(h)

    def front(self, h: Tensor, p: PassContext, st: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The layer up to its routed experts: the token mixer and its residual, the MoE input norm and the routing.
        Returns (h [T, D] after the mixer, x [T, D] the MoE input, w [T, k] fp32, idx [T, k] long)."""
        h, x = self.mixed(h, p, st)
        w, idx = self.mlp.route(x, p)
        return h, x, w, idx

    def back(self, h: Tensor, x: Tensor, routed: Tensor) -> Tensor:
        """The layer after its routed experts (``routed`` [T, D] from ``mlp.routed``): shared expert and residual."""
        return h + self.mlp.combine(x, routed)


class CloverModel(nn.Module):
    """The text model. Parameter names equal the checkpoint names with the weight prefix removed
    (``embed_tokens.weight``, ``layers.N....``, ``norm.weight``, ``lm_head.weight``).

    Construction allocates uninitialized storage (no random init): weights come from ``engine.weights.checkpoint``.
    Pass ``device="meta"`` for a shape-only skeleton. ``clover_extras`` (default: config.is_diffusion) creates the
    four Clover GDN tensors per linear-attention layer.
    """

    # forward takes ``head_rows`` (the decoding loops ask only models that say so; test fakes compute every row)
    computes_head_rows = True

    def __init__(
        self,
        config: CloverConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        clover_extras: bool | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        extras = config.is_diffusion if clover_extras is None else clover_extras
        with torch.device("meta"):
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(DecoderLayer(config, i, extras) for i in range(config.num_hidden_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        # model dtype everywhere except the fp32 GDN decay parameters
        for name, param in self.named_parameters():
            param.requires_grad_(False)
            if not name.endswith(FP32_PARAMS):
                param.data = param.data.to(dtype)
        if str(device) != "meta":
            self.to_empty(device=device)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.dtype = dtype
        # longest single pass when writing the cache; longer inputs are split into whole-block segments
        self.max_pass_tokens = 2048
        # engine.kernels.fastpath: what runs the AR steps (is_hot_pass) as one call (a compiled graph or CUDA graphs)
        self.step_graph: Callable[..., Tensor] | None = None
        # engine.kernels.fastpath on a GPU: what runs a whole block after the cache (denoising and commit passes) as CUDA
        # graphs (engine.kernels.step_graphs)
        self.pass_graph: Callable[..., Tensor] | None = None
        self._kept_cache: ModelCache | None = None  # new_cache, while the passes replay CUDA graphs

    @property
    def device(self) -> torch.device:
        """Where the layers run. The embedding table may live elsewhere (host RAM under a VRAM plan)."""
        return self.norm.weight.device

    def new_cache(self, max_len: int) -> ModelCache:
        """An empty cache for up to ``max_len`` tokens.

        When the passes replay CUDA graphs (``engine.kernels.step_graphs``, whose graphs belong to one cache), the model
        keeps one cache and hands it out again, emptied, to every request that fits in it (sized up to a multiple
        of 256 tokens: at most 255 more than asked, so a plan's context budget holds), so that a request replays the
        graphs the previous one recorded instead of recording them again before its first token (a few eager passes
        and the captures per pass kind and key bucket). One generation runs at a time, so one cache serves them
        all; a longer request replaces it."""
        if not getattr(self.step_graph, "keeps_cache", False):
            return ModelCache(self.config, max_len, self.dtype, self.device)
        kept = self._kept_cache
        if kept is None or kept.max_len < max_len:
            size = max(max_len, min(-(-max_len // 256) * 256, self.config.max_position_embeddings))
            # the old cache and the graphs recorded for it go before the longer one is allocated
            self._kept_cache = None
            self.step_graph.forget()  # type: ignore[union-attr]
            kept = self._kept_cache = ModelCache(self.config, size, self.dtype, self.device)
        else:
            kept.reset()
        return kept

    def hands_out(self, cache: ModelCache) -> bool:
        """Whether a request may go on in ``cache`` (engine.decode.prompt_cache.PromptCache): any cache, unless the model keeps
        one cache for its CUDA graphs and that is another one now (a longer request replaced it)."""
        return not getattr(self.step_graph, "keeps_cache", False) or cache is self._kept_cache

    def segment_tokens(self, block_size: int | None) -> int:
        """Length of the segments a cache-writing pass longer than ``max_pass_tokens`` is split into: whole blocks
        in block mode, whole GDN chunks in causal mode (every segment then starts where the math needs it to)."""
        unit = block_size or GDN_CHUNK
        return max(unit, self.max_pass_tokens // unit * unit)

    def moe_layers(self) -> list[SparseMoe]:
        return [layer.mlp for layer in self.layers]

    @torch.no_grad()
    def forward(
        self,
        ids: Tensor,
        start_pos: int = 0,
        cache: ModelCache | None = None,
        block_size: int | None = None,
        write_cache: bool = True,
        last_only: bool = False,
        *,
        prefill: bool = False,
        causal_inside_block: bool = False,
        head_rows: Tensor | None = None,
    ) -> Tensor:
        """Run ``ids`` [T] at absolute positions start_pos..start_pos+T-1 after the cached prefix.

        block_size None: causal (AR); T == 1 with a cache uses the recurrent GDN step.
        block_size B: block mode (start_pos % B == 0; only the last block may be partial): bidirectional attention
          inside each block, causal across blocks, Clover GDN extras and (if enabled) the MoE block coreset active.
        write_cache: append the tokens to the cache (KV, conv and recurrent state); False leaves it bit-identical.
        last_only: return only the last position's logits.
        prefill (keyword): this pass is the prompt prefill; the coreset applies only if config.coreset_in_prefill.
        causal_inside_block (keyword, for tests): causal attention inside blocks in block mode.
        head_rows (keyword): long [R], the only positions whose logits are wanted (a denoising pass's rows that still
          propose a masked slot): the final norm and the head run on those R rows alone (the head is the largest
          product of a pass; each row's logits are those of the full pass). Not with ``last_only``.
        Returns fp32 logits [T, V] (or [1, V], or [R, V]).
        """
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"ids must be a non-empty 1-D tensor, got shape {tuple(ids.shape)}")
        t = ids.shape[0]
        if head_rows is not None:
            self._check_head_rows(head_rows, t, last_only)
        if cache is not None:
            if start_pos != cache.length:
                raise ValueError(f"start_pos {start_pos} != cache.length {cache.length}")
            if start_pos + t > cache.max_len:
                raise PromptError(f"context full: {start_pos} + {t} tokens exceed the cache size {cache.max_len}")
        if block_size is not None and (block_size <= 0 or start_pos % block_size):
            raise ValueError(f"block mode needs start_pos ({start_pos}) to be a multiple of block_size ({block_size})")
        if cache is not None and write_cache and t > self.max_pass_tokens:
            # A long prefill runs as consecutive whole-block segments through the cache: the same math (blocks only
            # look back), with bounded attention-mask and activation memory. (engine.decode.loop_parts runs a long prompt's
            # segments itself, to report progress and honour a cancel between them.)
            seg = self.segment_tokens(block_size)
            outs = [
                self._forward_pass(ids[s : s + seg], start_pos + s, cache, block_size, True, last_only, prefill,
                                   causal_inside_block)
                for s in range(0, t, seg)
            ]
            logits = outs[-1] if last_only else torch.cat(outs)
            return logits if head_rows is None else logits.index_select(0, head_rows.to(logits.device))
        placement = getattr(self, "_offload_runtime", None)  # engine.placement.offload_runtime's runtime: its device tables
        if placement is not None:
            placement.before_pass(t, block_size)
        graph = None
        if self.step_graph is not None and cache is not None and self.is_hot_pass(t, block_size, write_cache):
            graph = self.step_graph
        elif (self.pass_graph is not None and cache is not None and block_size == t and not prefill
              and not causal_inside_block):
            graph = self.pass_graph
        if graph is None:
            return self._forward_pass(ids, start_pos, cache, block_size, write_cache, last_only, prefill,
                                      causal_inside_block, head_rows)
        logits = graph(ids, start_pos, cache, block_size, write_cache, last_only, prefill, causal_inside_block)
        # a recorded pass has fixed shapes: it computes every row, of which the wanted ones are taken
        return logits if head_rows is None else logits.index_select(0, head_rows.to(logits.device))

    @staticmethod
    def _check_head_rows(head_rows: Tensor, t: int, last_only: bool) -> None:
        if last_only:
            raise ValueError("head_rows and last_only exclude each other")
        if head_rows.dim() != 1 or head_rows.dtype != torch.long:
            raise ValueError(f"head_rows must be a 1-D long tensor, got {tuple(head_rows.shape)} {head_rows.dtype}")
        if head_rows.numel() and (int(head_rows.min()) < 0 or int(head_rows.max()) >= t):
            raise ValueError(f"head_rows must lie in 0..{t - 1}")

    @staticmethod
    def is_hot_pass(t: int, block_size: int | None, write_cache: bool) -> bool:
        """Whether a cached pass is an AR step (one token, causal, written to the cache): the pass a decode loop
        repeats hundreds of times, which :func:`engine.kernels.fastpath.compile_layers` compiles whole. (A denoising pass
        compiled whole measured no faster than layer by layer, 19.5 against 18-20 passes/s on the deep-narrow
        shape, and its variants took minutes to compile: its 32 rows are work, not overhead.)"""
        return t == 1 and block_size is None and write_cache

    def _forward_pass(
        self,
        ids: Tensor,
        start_pos: int,
        cache: ModelCache | None,
        block_size: int | None,
        write_cache: bool,
        last_only: bool,
        prefill: bool,
        causal_inside_block: bool,
        head_rows: Tensor | None = None,
    ) -> Tensor:
        t = ids.shape[0]
        cfg = self.config
        device = self.device
        ids = ids.to(device)
        positions = torch.arange(start_pos, start_pos + t, device=device)
        cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)
        mask, causal, rows = self._attention_mask(
            positions, start_pos, t, cache is not None, block_size, causal_inside_block
        )
        coreset = (
            block_size is not None and cfg.moe_block_coreset_enabled and (not prefill or cfg.coreset_in_prefill)
        )
        p = PassContext(start_pos, t, block_size, cache, write_cache, cos, sin, mask, causal, coreset, attn_rows=rows,
                  by_rows=bool(rows))
        h = self.embed(ids)  # [T, D]
        runs = layer_runs(self, h, p)  # an eager AR step on the CPU: runs of whole layers, one C call each
        i = 0
        while i < len(self.layers):
            run = runs.get(i)
            if run is not None:
                h, i = run(h, p), run.end
                continue
            layer = self.layers[i]
            st = cache.layer(i) if cache is not None else None
            if p.by_rows and layer.is_full_attention:
                # attention by row groups (host ints that a compiled layer would recompile for): the layer runs
                # eagerly, with its hooks (nn.Module._call_impl bypasses only torch.compile)
                h = layer._call_impl(h, p, st)
            else:
                h = layer(h, p, st)
            i += 1
        if last_only:  # a copy, as index_select makes for one head row: one compiled head graph serves both (a view
            # of the last row sits at a storage offset a compiled head is guarded on: a pass left with one masked
            # slot compiled another)
            h = h[-1:].clone()
        elif head_rows is not None:
            h = h.index_select(0, head_rows.to(h.device))  # [R, D]
        logits = self.head(h)  # [T, V] (or [1, V], [R, V])
        if cache is not None and write_cache:
            cache.length = start_pos + t
        return logits

    def head(self, h: Tensor) -> Tensor:
        """The final norm and the LM head: h [T, D] -> fp32 logits [T, V] (``engine.kernels.fastpath`` compiles it with the
        layers when the head is a plain linear)."""
        return self.lm_head(self.norm(h)).float()

    def static_step(self, h: Tensor, pos: Tensor, cache: ModelCache, kv_len: int) -> Tensor:
        """One AR step with nothing that depends on a host int, for capture as a CUDA graph (engine.kernels.step_graphs):
        ``h`` [1, D] the embedded token (in the model dtype, on the device), ``pos`` [1] long its position on the
        device, ``kv_len`` a fixed key length > pos (the full-attention layers read that many keys and mask the
        ones past ``pos``). Writes the cache like an AR step but leaves ``cache.length`` to the caller. Returns fp32
        logits [1, V]; the same as ``forward(ids, pos, cache, last_only=True)`` up to summation order."""
        p = self.static_pass(pos, cache, kv_len)
        return self.head(self.static_layers(h, p, cache, 0, len(self.layers)))

    def static_pass(
        self, pos: Tensor, cache: ModelCache, kv_len: int, t: int = 1, block_size: int | None = None,
        write_cache: bool = True,
    ) -> PassContext:
        """The pass of :meth:`static_step`, or of a whole block (``t == block_size``: a denoising pass with
        ``write_cache=False``, a commit pass with True), with nothing that depends on a host int: ``pos`` [1] long is
        the first position on the device, the rotary angles and the key mask [T, kv_len] are computed from it there.
        A block starts at a multiple of ``block_size`` (as :meth:`forward` requires), so the Gated DeltaNet chunk
        offset is 0 whatever the position."""
        if block_size is not None and t != block_size:
            raise ValueError(f"a static block pass runs one whole block ({block_size} tokens), not {t}")
        cfg = self.config
        positions = pos + torch.arange(t, device=pos.device)  # [T]
        cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta)
        keys = torch.arange(kv_len, device=pos.device)  # [S]
        if block_size is None:
            mask = keys[None, :] <= positions[:, None]  # [T, S]
        else:  # the prefix and the whole block
            mask = (keys[None, :] // block_size) <= (positions[:, None] // block_size)  # [T, S]
        coreset = block_size is not None and cfg.moe_block_coreset_enabled
        return PassContext(0, t, block_size, cache, write_cache, cos, sin, mask, False, coreset, pos=positions,
                     kv_len=kv_len)

    def static_layers(self, h: Tensor, p: PassContext, cache: ModelCache, lo: int, hi: int) -> Tensor:
        """Layers ``lo``..``hi - 1`` of a static pass (``p`` from :meth:`static_pass`): h [T, D] -> [T, D]."""
        for i in range(lo, hi):
            h = self.layers[i](h, p, cache.layer(i))
        return h

    def embed(self, ids: Tensor) -> Tensor:
        """ids [T] -> hidden states [T, D] on the layers' device, in the model dtype. A host-side table (kept in its
        stored dtype) sends only T rows over."""
        table = self.embed_tokens.weight
        return self.embed_tokens(ids.to(table.device)).to(device=self.device, dtype=self.dtype)

    @staticmethod
    def _attention_rows(
        start_pos: int, t: int, first_key: int, block_size: int | None
    ) -> tuple[tuple[int, int, int], ...]:
        """The query row groups of a masked pass (see :func:`attention_by_rows`): blocks in block mode, groups of
        :data:`ATTENTION_ROWS` in a causal one; (first row, end row, end of the keys any row of the group sees) each,
        keys counted from ``first_key``, the first key the pass reads."""
        size = block_size or ATTENTION_ROWS
        groups = []
        for r0 in range(0, t, size):
            r1 = min(t, r0 + size)
            # block mode: the block's own end (start_pos is a multiple of the block size); causal: the last row's
            # own position; never past the pass's last key
            last = start_pos + (r0 + size if block_size else r1)
            groups.append((r0, r1, min(last, start_pos + t) - first_key))
        return tuple(groups)

    @staticmethod
    def _attention_mask(
        positions: Tensor, start_pos: int, t: int, has_cache: bool, block_size: int | None, causal_inside: bool
    ) -> tuple[Tensor | None, bool, tuple[tuple[int, int, int], ...]]:
        """Boolean [T, S] mask (True = attend) or None, whether SDPA's is_causal covers it, and the query row groups
        attention runs in (:meth:`_attention_rows`; empty: one call). A block-causal pass over several blocks needs
        no mask: each block of rows reads exactly the keys up to its end."""
        first_key = 0 if has_cache else start_pos
        if block_size is None or causal_inside:
            if t == 1:
                return None, False, ()
            if first_key == start_pos:
                return None, True, ()  # keys == queries: plain causal
        elif (start_pos % block_size) + t <= block_size:
            return None, False, ()  # one block: every query sees the whole prefix and the whole block
        rows = CloverModel._attention_rows(start_pos, t, first_key, block_size)
        if block_size is not None and not causal_inside:
            return None, False, rows
        keys = torch.arange(first_key, start_pos + t, device=positions.device)  # [S]
        if block_size is None:
            return keys[None, :] <= positions[:, None], False, rows
        allowed = (keys[None, :] // block_size) <= (positions[:, None] // block_size)  # block-causal
        allowed &= keys[None, :] <= positions[:, None]  # and causal inside the blocks (causal_inside)
        return allowed, False, rows
