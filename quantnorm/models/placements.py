"""Where the normalization sits: one registry entry per placement (see shared FORMULAS.md).

The model carries a *stream*: a tuple of residual tensors. Every placement has one stream except
ResiDual, which keeps two. A placement says which norms each sublayer owns, how one sublayer
updates the stream (``step``), and how the final stream becomes the LM head's input
(``readout``). ``F`` below is a sublayer (attention or MLP), ``N`` the chosen norm.

| placement  | rule per sublayer                                   | final norm |
|------------|-----------------------------------------------------|------------|
| post       | x = N(x + F(x))                                     | none       |
| pre        | x = x + F(N(x))                                     | yes        |
| peri       | x = x + N_out(F(N_in(x)))                           | yes        |
| deepnorm   | x = N(alpha*x + F(x)), alpha = (2L)^(1/4)           | none       |
| residual   | f = F(x_a); x_d = x_d + f; x_a = N(x_a + f)         | N on x_d   |

ResiDual's output is ``x_a + N_final(x_d)``; both streams start as the embedding.
DeepNorm is the Post-LN rule with an up-weighted skip, not ``alpha*x + F(LN(x))`` (that would
be a Pre-LN variant whose residual grows like alpha^L).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError

Stream = tuple[torch.Tensor, ...]
Sublayer = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Placement:
    name: str
    sublayer_norms: tuple[str, ...]   # names of the norms each sublayer owns
    final_norm: bool                  # whether the model has a norm before the LM head
    n_streams: int
    step: Callable[[Stream, Sublayer, nn.ModuleDict, float], Stream]
    readout: Callable[[Stream, nn.Module | None], torch.Tensor]
    deepnorm_init: bool = False

    def residual_alpha(self, n_layers: int) -> float:
        """Weight of the skip connection: DeepNorm's (2L)^(1/4) for a decoder, else 1."""
        return (2 * n_layers) ** 0.25 if self.deepnorm_init else 1.0


def deepnorm_beta(n_layers: int) -> float:
    """DeepNorm's init gain for FFN, value and output projections of a decoder: (8L)^(-1/4)."""
    return (8 * n_layers) ** -0.25


def _post(s: Stream, f: Sublayer, n: nn.ModuleDict, alpha: float) -> Stream:
    (x,) = s
    return (n["norm"](x + f(x)),)


def _pre(s: Stream, f: Sublayer, n: nn.ModuleDict, alpha: float) -> Stream:
    (x,) = s
    return (x + f(n["norm"](x)),)


def _peri(s: Stream, f: Sublayer, n: nn.ModuleDict, alpha: float) -> Stream:
    (x,) = s
    return (x + n["norm_out"](f(n["norm_in"](x))),)


def _deepnorm(s: Stream, f: Sublayer, n: nn.ModuleDict, alpha: float) -> Stream:
    (x,) = s
    return (n["norm"](alpha * x + f(x)),)


def _residual(s: Stream, f: Sublayer, n: nn.ModuleDict, alpha: float) -> Stream:
    x_a, x_d = s
    out = f(x_a)
    return (n["norm"](x_a + out), x_d + out)


def _identity_readout(s: Stream, final: nn.Module | None) -> torch.Tensor:
    return s[0]


def _final_norm_readout(s: Stream, final: nn.Module | None) -> torch.Tensor:
    return final(s[0])


def _residual_readout(s: Stream, final: nn.Module | None) -> torch.Tensor:
    x_a, x_d = s
    return x_a + final(x_d)


PLACEMENTS: dict[str, Placement] = {
    p.name: p
    for p in [
        Placement("post", ("norm",), False, 1, _post, _identity_readout),
        Placement("pre", ("norm",), True, 1, _pre, _final_norm_readout),
        Placement("peri", ("norm_in", "norm_out"), True, 1, _peri, _final_norm_readout),
        Placement("deepnorm", ("norm",), False, 1, _deepnorm, _identity_readout, deepnorm_init=True),
        Placement("residual", ("norm",), True, 2, _residual, _residual_readout),
    ]
}


def get_placement(name: str) -> Placement:
    try:
        return PLACEMENTS[name]
    except KeyError:
        raise ConfigError(f"unknown placement {name!r}: choose one of {', '.join(PLACEMENTS)}") from None
