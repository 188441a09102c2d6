"""A GPT-style causal language model whose only varying parts are the norm and its placement.

Read top to bottom: config -> KV cache -> attention -> MLP -> block -> model. Learned positions,
GELU MLP, separate q/k/v projections (so DeepNorm can initialize v apart from q and k, and each
weight is its own MatMul for the quantizer), no dropout, an untied LM head.

Two forwards: ``forward(input_ids)`` scores whole windows (what is trained, exported and
quantized); ``forward_with_past`` is one step of generation against a KV cache (a prompt after
an empty past, then a token at a time), each attention keeping its own keys and values. ResiDual's
second stream needs nothing more: the cache holds only what attention computed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..data import VOCAB_SIZE
from ..errors import ConfigError
from .norms import NORMS, make_norm
from .placements import PLACEMENTS, Stream, deepnorm_beta, get_placement


@dataclass(frozen=True)
class ModelConfig:
    placement: str = "pre"
    norm: str = "rms"
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    context: int = 128
    vocab_size: int = VOCAB_SIZE

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"unknown placement {self.placement!r}: choose one of {', '.join(PLACEMENTS)}")
        if self.norm not in NORMS:
            raise ConfigError(f"unknown norm {self.norm!r}: choose one of {', '.join(NORMS)}")
        for name in ("n_layers", "d_model", "n_heads", "context", "vocab_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"d_model {self.d_model} is not divisible by heads {self.n_heads}: pick heads that divide d_model"
            )

    def to_dict(self) -> dict:
        return asdict(self)


KV = tuple[torch.Tensor, torch.Tensor]  # one attention's (keys, values), each [batch, heads, length, head_dim]


@dataclass
class LayerCache:
    """One attention's cache during a step: its keys and values so far, and the visibility mask.

    ``keep`` (``cache_keep``) is 1 where a new query may attend a key. The attention
    appends this step's keys and values (``extend``), so after the step ``key``/``value`` are the
    present that the next step takes as its past.
    """
    key: torch.Tensor
    value: torch.Tensor
    keep: torch.Tensor

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> KV:
        self.key = torch.cat([self.key, k], dim=2)
        self.value = torch.cat([self.value, v], dim=2)
        return self.key, self.value


def cache_keep(past: int, seq: int, attention_mask: torch.Tensor | None, device=None) -> torch.Tensor:
    """Which keys the ``seq`` new queries see after ``past`` cached ones, as 1/0: [seq, past + seq],
    or [batch, 1, seq, past + seq] with an ``attention_mask``.

    Causal in cache slots (query i sits in slot past + i) and, with an ``attention_mask``
    [batch, past + seq] (0 = padding), never a padded key, except a query's own slot: a row with
    nothing to attend to would divide by zero in ``masked_softmax`` (a padded query's output is
    never read).
    """
    slots = torch.arange(past + seq, device=device)
    keep = slots[None, :] <= slots[past:, None]
    if attention_mask is not None:
        own = slots[None, :] == slots[past:, None]
        keep = keep & ((attention_mask[:, None, None, :] != 0) | own)
    return keep.float()


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        # 1 where a query may attend (key position <= query position), else 0.
        self.register_buffer("causal", torch.tril(torch.ones(cfg.context, cfg.context)), persistent=False)
        # A no-op whose forward hook lets the probe read the attention weights.
        self.probs_tap = nn.Identity()

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        """Whole windows (``cache`` None), or one generation step that extends ``cache``."""
        B, T, C = x.shape
        q = self.q(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        if cache is not None:
            k, v = cache.extend(k, v)  # the past's keys and values, then this step's
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        keep = self.causal[:T, :T] if cache is None else cache.keep
        probs = self.probs_tap(masked_softmax(scores, keep))
        y = (probs @ v).transpose(1, 2).reshape(B, T, C)
        return self.proj(y)


def masked_softmax(scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Softmax over the positions where ``keep`` is 1, with no -inf and no huge constant.

    The usual ``masked_fill(-inf)`` puts -inf into a tensor that ONNX Runtime's static quantizer
    calibrates: it gets an infinite scale and the INT8 model turns to noise with only a
    RuntimeWarning (a large finite fill such as -1e4 is finite but still wrecks the scale).
    Here the mask multiplies instead, so every intermediate tensor stays within the range of the
    real scores or of [0, 1]:
      m = max over keys of scores*keep      (>= the largest allowed score, never a masked one's size)
      e = exp(clip(scores - m, -80, 0)) * keep
      p = e / sum(e)
    The clip keeps masked entries from overflowing before they are zeroed and keeps the row sum
    positive (the diagonal is always kept). Equal to a softmax over the allowed keys.
    """
    m = (scores * keep).amax(dim=-1, keepdim=True)
    e = torch.exp(torch.clamp(scores - m, min=-80.0, max=0.0)) * keep
    return e / e.sum(dim=-1, keepdim=True)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.down = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Attention then MLP, each wired into the stream by the placement's rule."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.placement = get_placement(cfg.placement)
        self.alpha = self.placement.residual_alpha(cfg.n_layers)
        self.attn = CausalSelfAttention(cfg)
        self.mlp = MLP(cfg)
        self.attn_norms = nn.ModuleDict({n: make_norm(cfg.norm, cfg.d_model) for n in self.placement.sublayer_norms})
        self.mlp_norms = nn.ModuleDict({n: make_norm(cfg.norm, cfg.d_model) for n in self.placement.sublayer_norms})

    def forward(self, stream: Stream, cache: LayerCache | None = None) -> Stream:
        attn = self.attn if cache is None else partial(self.attn, cache=cache)
        stream = self.placement.step(stream, attn, self.attn_norms, self.alpha)
        return self.placement.step(stream, self.mlp, self.mlp_norms, self.alpha)


class CausalLM(nn.Module):
    """``input_ids`` [batch, seq] int64 -> ``logits`` [batch, seq, vocab] float32."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.placement = get_placement(cfg.placement)
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.final_norm = make_norm(cfg.norm, cfg.d_model) if self.placement.final_norm else None
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init (std 0.02, residual projections scaled by 1/sqrt(2L)), or DeepNorm's."""
        L = self.cfg.n_layers
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.blocks:
            if self.placement.deepnorm_init:
                beta = deepnorm_beta(L)
                for lin in (block.mlp.up, block.mlp.down, block.attn.v, block.attn.proj):
                    nn.init.xavier_normal_(lin.weight, gain=beta)
                for lin in (block.attn.q, block.attn.k):
                    nn.init.xavier_normal_(lin.weight, gain=1.0)
            else:
                for lin in (block.attn.proj, block.mlp.down):
                    nn.init.normal_(lin.weight, mean=0.0, std=0.02 / math.sqrt(2 * L))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[1]
        positions = torch.arange(T, device=input_ids.device)
        return self.tok_emb(input_ids) + self.pos_emb(positions)[None]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        stream: Stream = (x,) * self.placement.n_streams
        for block in self.blocks:
            stream = block(stream)
        return self.head(self.placement.readout(stream, self.final_norm))

    def forward_with_past(self, input_ids: torch.Tensor, past: Sequence[KV] | None = None,
                          position_ids: torch.Tensor | None = None,
                          attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, list[KV]]:
        """One generation step: ``input_ids`` [batch, seq] after ``past`` -> (logits, present).

        ``past``: per layer (keys, values) [batch, heads, past, head_dim], None for a prompt.
        ``position_ids`` [batch, seq] default to past, past + 1, ... (positions continue from the
        cache); ``attention_mask`` [batch, past + seq] (1 = token, 0 = padding) defaults to all
        ones. ``present``: per layer the past with this step's keys and values appended.
        """
        B, T = input_ids.shape
        if past is None:
            empty = self.tok_emb.weight.new_zeros(B, self.cfg.n_heads, 0, self.cfg.d_model // self.cfg.n_heads)
            past = [(empty, empty)] * self.cfg.n_layers
        P = past[0][0].shape[2]
        if position_ids is None:
            position_ids = torch.arange(P, P + T, device=input_ids.device)[None].expand(B, T)
        keep = cache_keep(P, T, attention_mask, device=input_ids.device)
        caches = [LayerCache(k, v, keep) for k, v in past]
        x = self.tok_emb(input_ids) + self.pos_emb(position_ids)
        stream: Stream = (x,) * self.placement.n_streams
        for block, cache in zip(self.blocks, caches, strict=True):
            stream = block(stream, cache)
        logits = self.head(self.placement.readout(stream, self.final_norm))
        return logits, [(c.key, c.value) for c in caches]

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
