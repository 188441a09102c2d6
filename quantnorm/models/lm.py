"""A GPT-style causal language model whose only varying parts are the norm and its placement.

Read top to bottom: config -> attention -> MLP -> block -> model. Learned positions, GELU MLP,
separate q/k/v projections (so DeepNorm can initialize v apart from q and k, and each weight
is its own MatMul for the quantizer), no dropout, an untied LM head.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = self.q(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        probs = self.probs_tap(masked_softmax(scores, self.causal[:T, :T]))
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

    def forward(self, stream: Stream) -> Stream:
        stream = self.placement.step(stream, self.attn, self.attn_norms, self.alpha)
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

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
