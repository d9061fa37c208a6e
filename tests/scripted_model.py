"""A tiny Clover checkpoint whose weights are set so that it writes chosen text (tests of the HTTP server).

Random tiny weights write noise; the server's tool-call and thinking paths need a model that writes, say,
``<tool_call>{"name": ...}</tool_call>`` on cue. The construction is a bigram machine:

* every layer's output projections (attention ``o_proj``, Gated DeltaNet ``out_proj``, routed and shared expert
  ``down_proj``) are zero, so each layer adds nothing and the residual stream at a position is the embedding of the
  token there;
* embeddings are random unit directions (times sqrt(D), so the final RMSNorm leaves them as they are) with
  dimension 0 reserved for the mask token: the mask's embedding is ``sqrt(D) * e_0`` and no other token touches
  dimension 0;
* ``lm_head`` row ``next(t)`` is ``ALPHA * unit(embed[t])`` for each scripted transition ``t -> next(t)`` and zero
  elsewhere: after token t, ``next(t)`` scores ``ALPHA * sqrt(D)`` while every other row scores about
  ``ALPHA * N(0, 1)``; after a mask every row scores exactly 0 (a flat distribution, confidence 1/V);
* ``config.json`` has ``shift_logits: true`` (logit row i predicts token i+1), so in block diffusion a masked slot
  is predicted from the token before it: the leftmost masked slot of a block follows a committed token and
  commits with confidence ~1, every other masked slot follows a mask and stays under the threshold. Diffusion and
  AR decoding both write the script, one token per pass.

Each scripted token (except a chain's last) must have one successor, so a script is tokenized with *distinct*
tokens (``"`` can be written as ``"``, ``":``, ``",``, ``{"`` ...): :func:`distinct_tokenization` searches for one.
A script starts after the last token of the chat template's generation prompt: ``<think>\\n`` with thinking on,
``</think>\\n\\n`` with it off, so one model can answer differently in the two modes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ALPHA = 5.0  # logit scale of a scripted transition: a gap of ~ALPHA * (sqrt(64) - 3) = 25 nats over any other row


@dataclass(frozen=True)
class ScriptedModel:
    """A written model folder and the token chains it follows (start token -> scripted ids)."""

    path: Path
    chains: dict[int, tuple[int, ...]]
    texts: dict[str, str]  # "thinking" / "no_thinking" -> the text written after that generation prompt
    loops: frozenset[int] = frozenset()  # start tokens whose chain starts over after its last token, forever


def generation_prompt_end(tokenizer, enable_thinking: bool) -> int:  # noqa: ANN001 - a CloverTokenizer
    """The last token of the chat template's generation prompt (where a script starts)."""
    return tokenizer.encode_chat([{"role": "user", "content": "x"}], enable_thinking=enable_thinking)[-1]


def distinct_tokenization(tokenizer, text: str, avoid: Iterable[int] = ()) -> list[int]:  # noqa: ANN001
    """Token ids that decode to ``text``, no id twice and none from ``avoid``.

    Added tokens written in ``text`` (``<tool_call>``, ``</think>``, ``<|im_end|>``, :func:`add_plain_tokens`'
    pieces) are kept as their single id; the plain stretches between them are searched depth first, longest vocabulary piece first. Raises
    ValueError when no such tokenization exists.
    """
    used = set(avoid)
    pieces: dict[str, int] = {}
    for token_id in range(tokenizer.vocab_size):
        piece = tokenizer.decode([token_id], skip_special_tokens=False)
        if piece and "\ufffd" not in piece and piece not in pieces:
            pieces.setdefault(piece, token_id)
    added = tokenizer._tok.get_added_tokens_decoder()  # id -> AddedToken: special and plain added tokens
    specials = sorted((t.content for t in added.values()), key=len, reverse=True)
    pieces.update({t.content: i for i, t in added.items()})
    by_length = sorted(pieces.items(), key=lambda kv: -len(kv[0]))

    def plain(segment: str) -> list[int]:
        budget = [200_000]

        def search(pos: int) -> list[int] | None:
            if pos == len(segment):
                return []
            budget[0] -= 1
            if budget[0] < 0:
                return None
            for piece, token_id in by_length:
                if token_id in used or piece in specials or not segment.startswith(piece, pos):
                    continue
                used.add(token_id)
                rest = search(pos + len(piece))
                if rest is not None:
                    return [token_id, *rest]
                used.discard(token_id)
            return None

        found = search(0)
        if found is None:
            raise ValueError(f"no tokenization of {segment!r} with distinct tokens")
        return found

    out: list[int] = []
    pos = 0
    while pos < len(text):
        special = next((s for s in specials if text.startswith(s, pos)), None)
        if special is not None:
            token_id = pieces[special]
            if token_id in used:
                raise ValueError(f"{special!r} appears twice in {text!r} (or is a start token)")
            used.add(token_id)
            out.append(token_id)
            pos += len(special)
            continue
        end = min((i for i in (text.find(s, pos) for s in specials) if i >= 0), default=len(text))
        out.extend(plain(text[pos:end]))
        pos = end
    if tokenizer.decode(out, skip_special_tokens=False) != text:
        raise ValueError(f"the tokenization of {text!r} does not decode back to it")
    return out


def scripted_state_dict(
    config, chains: Mapping[int, Sequence[int]], seed: int = 0, loops: Iterable[int] = ()  # noqa: ANN001
) -> dict:
    """Weights for ``config`` that follow ``chains`` (see the module docstring); the chains of the start tokens in
    ``loops`` go back to their first token after their last. Names without the prefix."""
    import torch

    from clover_desk.engine.weights.checkpoint import random_state_dict

    successor = _successors(chains, loops)
    if successor is None:
        raise ValueError(f"some token would need two successors in {dict(chains)}")
    mask_id = config.mask_token_id
    if mask_id is None or mask_id in successor or mask_id in successor.values():
        raise ValueError("the model needs a mask token that no script uses")
    sd = random_state_dict(config, seed=seed, clover_extras="neutral")
    for name in list(sd):
        if name.endswith(("self_attn.o_proj.weight", "linear_attn.out_proj.weight", "experts.down_proj",
                          "shared_expert.down_proj.weight")):
            sd[name] = torch.zeros_like(sd[name])
    v, d = config.vocab_size, config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(v, d, generator=gen)  # [V, D]
    embed[:, 0] = 0.0  # dimension 0 belongs to the mask alone
    embed = embed / embed.norm(dim=-1, keepdim=True) * math.sqrt(d)  # RMS 1: the final RMSNorm is the identity
    embed[mask_id] = 0.0
    embed[mask_id, 0] = math.sqrt(d)
    sd["embed_tokens.weight"] = embed
    sd["norm.weight"] = torch.zeros(d)  # (1 + w) = 1
    head = torch.zeros(v, d)  # [V, D]
    for prev, nxt in successor.items():
        head[nxt] += ALPHA * embed[prev] / math.sqrt(d)
    sd["lm_head.weight"] = head
    return sd


def add_plain_tokens(model_dir: Path, pieces: Sequence[str]) -> None:
    """Add ``pieces`` to the folder's tokenizer.json as plain (non-special) added tokens: each decodes as its
    text, so a script can write a whole JSON object as one token (the tiny BPE has too few quote merges to spell
    one with distinct tokens)."""
    from tokenizers import AddedToken, Tokenizer

    path = model_dir / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    tok.add_tokens([AddedToken(p, special=False, normalized=False) for p in pieces])
    tok.save(str(path))


def _successors(chains: Mapping[int, Sequence[int]], loops: Iterable[int] = ()) -> dict[int, int] | None:
    """token -> the token that follows it in the chains, or None when some token would need two."""
    successor: dict[int, int] = {}
    loops = set(loops)
    for start, chain in chains.items():
        pairs = list(zip([start, *chain[:-1]], chain))
        if start in loops:
            pairs.append((chain[-1], chain[0]))
        for prev, nxt in pairs:
            if successor.setdefault(prev, nxt) != nxt:
                return None
    return successor


def _consistent(chains: Mapping[int, Sequence[int]], start: int, chain: Sequence[int], loops: Iterable[int]) -> bool:
    return _successors({**chains, start: chain}, loops) is not None


def build_scripted_model(
    out_dir: str | Path,
    *,
    thinking: str | None = None,
    no_thinking: str | None = None,
    extra_tokens: Sequence[str] = (),
    loop: Iterable[str] = (),
    seed: int = 0,
) -> ScriptedModel:
    """Write a tiny ``clover_moe`` folder (tokenizer, templates, generation config) that writes ``thinking`` after
    a thinking-on generation prompt and ``no_thinking`` after a thinking-off one (each should end in
    ``<|im_end|>``; ``thinking`` holds ``</think>`` where the reasoning ends). ``extra_tokens`` are added to the
    tokenizer as plain tokens first (see :func:`add_plain_tokens`). The scripts named in ``loop`` ("thinking",
    "no_thinking") start over after their last token instead of ending: such a model writes forever (end them
    without ``<|im_end|>``)."""
    from clover_desk.engine.decode.tokenizer import (
        ENDOFTEXT,
        IM_END,
        MASK,
        THINK_END,
        CloverTokenizer,
        train_tiny_tokenizer,
    )
    from clover_desk.engine.model.config import parse_config
    from clover_desk.engine.weights.checkpoint import write_checkpoint
    from clover_desk.engine.weights.tiny import config_dict_for, tiny_text_config, write_generation_config

    out = Path(out_dir)
    tokenizer = train_tiny_tokenizer(out, 1024)
    if extra_tokens:
        add_plain_tokens(out, extra_tokens)
        tokenizer = CloverTokenizer.from_dir(out)
    special = {name: tokenizer.token_to_id(name) for name in (ENDOFTEXT, IM_END, MASK, THINK_END)}
    text = tiny_text_config(vocab_size=-(-tokenizer.vocab_size // 64) * 64, max_position_embeddings=4096)
    config_dict = {**config_dict_for("clover_moe", text, special), "shift_logits": True}
    config = parse_config(config_dict, source=str(out / "config.json"))
    starts = {True: generation_prompt_end(tokenizer, True), False: generation_prompt_end(tokenizer, False)}
    chains: dict[int, tuple[int, ...]] = {}
    texts: dict[str, str] = {}
    loops = {starts[key == "thinking"] for key in loop}
    for key, script, on in (("thinking", thinking, True), ("no_thinking", no_thinking, False)):
        if script is None:
            continue
        start = starts[on]
        # Two scripts may share a tail (the same tool call after different reasoning) when every shared token
        # keeps its successor; otherwise the second one is spelled with tokens the first does not use.
        chain = distinct_tokenization(tokenizer, script, set(starts.values()))
        if not _consistent(chains, start, chain, loops):
            taken = {t for s, c in chains.items() for t in (c if s in loops else c[:-1])}
            chain = distinct_tokenization(tokenizer, script, set(starts.values()) | taken)
        chains[start] = tuple(chain)
        texts[key] = script
    write_checkpoint(out, scripted_state_dict(config, chains, seed, loops), config_dict, max_shard_bytes=1 << 40)
    write_generation_config(out, "clover_moe", special)
    (out / "scripted.json").write_text(json.dumps({str(k): list(v) for k, v in chains.items()}), encoding="utf-8")
    return ScriptedModel(out, chains, texts, frozenset(loops))
