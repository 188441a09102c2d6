"""Rotating a Pre-RMSNorm checkpoint's residual stream (QuaRot-style, Hadamard), exactly in FP32.

Why: per-token INT8 gives each token its own scale, but inside one row a few outlier channels
still set the step for all the others. An orthogonal rotation ``Q`` of the residual stream
spreads every channel's energy over all of them (a Hadamard matrix does so evenly: each entry is
``+-1/sqrt(d)``), and the model computes the same function:

- each norm's weight ``g`` is first folded into the Linears that read the norm's output
  (``W <- W diag(g)``, then ``g = 1``), because ``RMSNorm(x Q) = RMSNorm(x) Q`` holds only for
  a norm without a per-channel weight;
- the embedding rows are rotated (``E <- E Q``), every Linear that reads the stream gets
  ``W <- W Q`` (q, k, v, gate, up, the head) and every Linear that writes into it gets
  ``W <- Q^T W`` (o, down; a bias ``b <- b Q``);
- the head is untied from the embedding (the final norm's weight folds into the head only);
- the down-projection input, where SmolLM2's largest MatMul input lives (about 3,000 on the first
  token), is not part of the stream: it gets an *online* Hadamard, ``h -> h H`` computed in the
  graph, with ``W_down <- W_down H``. ``H = H_a (x) H_b`` is applied as two small MatMuls on an
  ``[a, b]`` view of ``h`` (and a transpose), ``O(a + b)`` work per element instead of ``O(a b)``. Those MatMuls are
  part of the FP32 model: their module is named ``online_hadamard`` and no recipe quantizes them.

Form (c), ``block<b>``, serves weight-only recipes whose activations are quantized per block of
``b`` along K (MatMulNBits, accuracy_level 4): every Linear's input gets ``I (x) H_b``, a Hadamard
inside each of those blocks, as one MatMul on an ``[n / b, b]`` view, and the weight absorbs it.
A block's outlier is spread over the block that owns its scale and no further, and a decode step
runs one small MatMul per input instead of two and a transpose (form b's).

Form (d), ``stream-block<b>``, is form (a) for those same weight-only recipes on Pre-RMSNorm
checkpoints, with as few operators in a step as the algebra allows: the stream rotation leaves the
q/k/v, gate/up and head inputs rotated at no cost in the graph; the down-projection input gets
form (c)'s one MatMul (``I (x) H_b``); and the o-projection's input, the attention output, is rotated
inside each block of ``b`` of every head with no operator at all: ``H_b`` folds into the value
projection's output columns (``W_v <- M^T W_v``, each head's values ``v M``; the attention's
weighted sum of values then comes out rotated, ``P (V M) = (P V) M``) and into the o-projection's
input (``W_o <- W_o M``). It needs ``b`` to divide the head dimension (a block never straddles two
heads). The KV cache then holds the rotated values: one more reason it is part of the FP32 model.

This is exact for the Pre-RMSNorm dataflow (LLaMA, Mistral, Qwen2). For Peri-LN (Gemma 2/3) the
stream rotation is exact too but harmful: the model discards a component of the normalized
stream before every Linear, and rotation spreads it over every input, so it
is refused for them with the reason; ``rotation_support`` says which form applies where.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..errors import ConfigError
from ..export import export_onnx
from ..fileio import release_memory
from ..module_export import check_matches_original, export_module_onnx

ROTATABLE_FAMILIES = ("llama", "mistral", "qwen2")
PALEY_PRIMES = (11, 19, 23, 43, 47, 59, 67, 71, 79, 83)  # q = 3 mod 4: Hadamard order q + 1
PALEY_ORDERS = tuple(q + 1 for q in PALEY_PRIMES)        # (the powers of two come from Sylvester)
DEFAULT_PARITY_TOLERANCE = 1e-3   # relative to each output's scale, as the SmoothQuant export gate
ROW_BLOCK = 8192   # rows of a weight transformed in float64 at a time


def by_row_blocks(weight: torch.Tensor, fn) -> torch.Tensor:
    """``fn(weight in float64)`` as a new float32 tensor, computed a block of rows at a time: ``fn``
    must treat each row on its own (a product on the right, a scale per column). A large matrix
    (Gemma 3's 262k x 640 head and embedding) then never has whole float64 copies beside it: 2.7 GB
    more at once, the peak of a rotated export's memory."""
    out = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
    for lo in range(0, weight.shape[0], ROW_BLOCK):
        out[lo:lo + ROW_BLOCK] = fn(weight[lo:lo + ROW_BLOCK].detach().double())
    return out


# ---------------------------------------------------------------------------------------------
# Hadamard matrices

# Modules of this name are online rotations inside the FP32 model: their MatMuls multiply by a
# constant Hadamard matrix, and no recipe quantizes them (quantize.ort_backend skips the name).
ONLINE_ROTATION_MARKER = "online_hadamard"


def sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def paley(q: int) -> np.ndarray:
    """Paley's construction I: a Hadamard matrix of order q + 1 for a prime q = 3 (mod 4)."""
    residues = {(i * i) % q for i in range(1, q)}
    chi = np.array([0] + [1 if i in residues else -1 for i in range(1, q)])
    jac = np.array([[chi[(j - i) % q] for j in range(q)] for i in range(q)])
    s = np.zeros((q + 1, q + 1))
    s[0, 1:] = 1
    s[1:, 0] = -1
    s[1:, 1:] = jac
    return s + np.eye(q + 1)


def hadamard_factors(n: int) -> list[int] | None:
    """Orders whose Kronecker product is n (Paley orders, then one power of two), or None."""
    if _is_power_of_two(n):
        return [n]
    for order in PALEY_ORDERS:
        if n % order == 0:
            rest = hadamard_factors(n // order)
            if rest is not None:
                return [order] + rest
    return None


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def hadamard_block(order: int) -> np.ndarray:
    if _is_power_of_two(order):
        return sylvester(order)
    return paley(order - 1)


def hadamard(n: int) -> np.ndarray:
    """An orthonormal Hadamard matrix of order n (entries +-1/sqrt(n)), float64."""
    factors = hadamard_factors(n)
    if factors is None:
        raise ConfigError(f"no Hadamard matrix of order {n} from Sylvester and Paley blocks")
    h = np.ones((1, 1))
    for order in factors:
        h = np.kron(h, hadamard_block(order))
    h = h / np.sqrt(n)
    if not np.allclose(h @ h.T, np.eye(n), atol=1e-9):
        raise AssertionError(f"Hadamard construction of order {n} is not orthogonal")
    return h


def randomized_hadamard(n: int, seed: int = 0) -> np.ndarray:
    """``diag(+-1) H``: QuaRot's randomized Hadamard (still orthogonal, entries +-1/sqrt(n))."""
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=n)
    return signs[:, None] * hadamard(n)


def split_for_online(n: int) -> tuple[int, int]:
    """``n = a * b`` with a Hadamard of each order and ``a`` small: the online rotation's two steps."""
    best = None
    for a in range(1, n + 1):
        if n % a:
            continue
        b = n // a
        if hadamard_factors(a) is not None and _is_power_of_two(b):
            if best is None or a + b < sum(best):
                best = (a, b)
    if best is None:
        raise ConfigError(f"no two-step Hadamard for the down-projection input of width {n}")
    return best


# ---------------------------------------------------------------------------------------------
# The rotation on a checkpoint


def rotation_support(spec) -> str | None:
    """None when the residual-stream rotation applies to this architecture, else why not."""
    if spec.model_type not in ROTATABLE_FAMILIES:
        if spec.placement == "peri":
            return (f"{spec.family} is Peri-LN with (1 + w) norms: the stream rotation is exact but measured "
                    "harmful (the model discards a normalized-stream component before every Linear; rotation "
                    "spreads it into every input's per-token scale)")
        return f"{spec.family} ({spec.placement}/{spec.norm}): residual-stream rotation is implemented for " \
               f"Pre-RMSNorm {', '.join(ROTATABLE_FAMILIES)} only"
    return None


@dataclass
class RotationPlan:
    d_model: int
    stream: str
    online: str
    layers: int
    untied_head: bool
    folded_norms: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"d_model": self.d_model, "stream_rotation": self.stream, "online_rotation": self.online,
                "layers": self.layers, "untied_head": self.untied_head, "folded_norms": len(self.folded_norms)}


def rotate_wrapper(wrapper, spec, seed: int = 0, *, in_place: bool = False, block: int | None = None):
    """A rotated deep copy of ``wrapper`` (the CausalLMWrapper around a LLaMA-family model) and its
    plan; ``in_place``: ``wrapper`` itself rotated (a caller that reloads the original). ``block``:
    form (d), the down-projection's input rotated inside blocks of ``block`` and the attention
    output likewise, folded into the value and o-projections."""
    why = rotation_support(spec)
    if why is not None:
        raise ConfigError(f"rotation: {why}")
    if block is not None:   # refused before any weight changes (an in-place rotation is never left half done)
        _check_stream_block(wrapper.model, block)
    rotated = wrapper if in_place else copy.deepcopy(wrapper)
    lm = rotated.model
    base = lm.base_model
    embed = base.embed_tokens
    d = embed.weight.shape[1]
    q = torch.from_numpy(randomized_hadamard(d, seed))
    head = lm.lm_head
    untied = head.weight is embed.weight or head.weight.data_ptr() == embed.weight.data_ptr()
    if untied:
        head.weight = nn.Parameter(embed.weight.detach().clone())
        lm.config.tie_word_embeddings = False
    plan = RotationPlan(d, f"randomized Hadamard {'x'.join(map(str, hadamard_factors(d)))} (order {d}, seed {seed})",
                        "", len(base.layers), untied)

    def fold(norm, linears):
        g = norm.weight.detach().double()
        for lin in linears:
            lin.weight.data = by_row_blocks(lin.weight, lambda rows: rows * g[None, :])
        norm.weight.data.fill_(1.0)
        plan.folded_norms.append(type(norm).__name__)

    def read(lin):   # a Linear reading the stream: W <- W Q
        lin.weight.data = by_row_blocks(lin.weight, lambda rows: rows @ q)

    def write(lin):  # a Linear writing into the stream: W <- Q^T W, b <- b Q
        lin.weight.data = (q.T @ lin.weight.detach().double()).float()
        if lin.bias is not None:
            lin.bias.data = (lin.bias.detach().double() @ q).float()

    with torch.no_grad():
        width = None
        for layer in base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            fold(layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj])
            fold(layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj])
            for lin in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
                read(lin)
            if block is not None:
                rotate_values_per_head(attn.v_proj, attn.o_proj, block)
            write(attn.o_proj)
            width = mlp.down_proj.in_features
            if block is None:
                a, b = split_for_online(width)
                online = OnlineHadamard(a, b)
            else:
                online = BlockHadamard(width, block)
            m = online.matrix()
            mlp.down_proj.weight.data = by_row_blocks(mlp.down_proj.weight, lambda rows, m=m: rows @ m)
            write(mlp.down_proj)
            mlp.down_proj = RotatedInput(online, mlp.down_proj)
        fold(base.norm, [head])
        read(head)
        embed.weight.data = by_row_blocks(embed.weight, lambda rows: rows @ q)
    if block is None:
        plan.online = f"Hadamard {a}x{b} (order {width}) before each down-projection, two MatMuls in the graph"
    else:
        plan.online = (f"Hadamard inside each block of {block} before each down-projection (width {width}, one MatMul "
                       f"in the graph) and inside each block of {block} of every head's values (folded into the "
                       "value and o-projections: no operator)")
    return rotated.eval(), plan


def _check_stream_block(model, block: int) -> None:
    """Form (d)'s shapes: ``block`` divides each down-projection's input and the head dimension."""
    if not _is_power_of_two(block):
        raise ConfigError(f"a stream block rotation needs a power-of-two block, got {block}")
    for i, layer in enumerate(model.base_model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        head_dim = int(getattr(attn, "head_dim", 0) or 0)
        if not head_dim or head_dim % block:
            raise ConfigError(f"a stream block rotation of {block} folds a Hadamard into each head's values, and "
                              f"layer {i}'s heads are {head_dim or 'of unknown'} wide: choose a block that divides "
                              "the head dimension")
        if mlp.down_proj.in_features % block:
            raise ConfigError(f"a stream block rotation of {block} needs the down-projection's input width "
                              f"({mlp.down_proj.in_features}, layer {i}) to be a multiple of it: choose a block "
                              "that divides it")


def rotate_values_per_head(v_proj: nn.Linear, o_proj: nn.Linear, block: int) -> None:
    """``M = I (x) H_block`` into each head's values and out of the o-projection's input, in place:
    ``W_v <- M^T W_v`` (``b_v <- b_v M``) and ``W_o <- W_o M``. Exact because attention mixes value
    rows (tokens), never their columns, and each block lies inside one head (``block`` divides the
    head dimension); with grouped heads every query head reading a value head gets it rotated alike."""
    m_v = BlockHadamard(v_proj.out_features, block).matrix()
    v_proj.weight.data = (m_v.T @ v_proj.weight.detach().double()).float()
    if v_proj.bias is not None:
        v_proj.bias.data = (v_proj.bias.detach().double() @ m_v).float()
    m_o = BlockHadamard(o_proj.in_features, block).matrix()
    o_proj.weight.data = by_row_blocks(o_proj.weight, lambda rows: rows @ m_o)


class OnlineHadamard(nn.Module):
    """``h -> h M`` with ``M = (H_a (x) H_b) P``: on an ``[a, b]`` view of ``h``, ``X H_b``, then a
    transpose and ``H_a`` on the other axis. Both MatMuls have the constant on the right, so ONNX
    Runtime runs each as one large GEMM over all tokens (a constant on the left becomes thousands of
    tiny batched products, slower than the FP32 model). The transpose leaves the output in
    ``[b, a]`` order, a channel permutation ``P`` that ``matrix()`` includes and the weight absorbs."""

    def __init__(self, a: int, b: int):
        super().__init__()
        self.a, self.b = a, b
        self.register_buffer("left", torch.from_numpy(hadamard(a).copy()).float())
        self.register_buffer("right", torch.from_numpy(hadamard(b).copy()).float())

    def matrix(self) -> torch.Tensor:
        """``M`` in float64, read off the module itself (rows: the images of the basis vectors)."""
        eye = torch.eye(self.a * self.b, dtype=torch.float64)
        x = torch.matmul(eye.reshape(-1, self.a, self.b), self.right.double())
        return torch.matmul(x.transpose(-1, -2), self.left.double()).reshape(-1, self.a * self.b)

    def forward(self, h):
        shape = h.shape
        x = torch.matmul(h.reshape(*shape[:-1], self.a, self.b), self.right)
        return torch.matmul(x.transpose(-1, -2), self.left).reshape(shape)


class BlockHadamard(nn.Module):
    """``h -> h (I (x) H_b)``: a Hadamard of order ``b`` inside each block of ``b`` channels, one MatMul
    on an ``[n / b, b]`` view of ``h`` (no transpose: each block stays where it was)."""

    def __init__(self, width: int, b: int):
        super().__init__()
        if width % b:
            raise ConfigError(f"a block rotation of {b} needs input widths that are multiples of {b}, got {width}: "
                              f"choose a block that divides every Linear's input width")
        self.width, self.b = width, b
        self.register_buffer("right", torch.from_numpy(hadamard(b).copy()).float())

    def matrix(self) -> torch.Tensor:
        """``I (x) H_b`` in float64."""
        return torch.block_diag(*[self.right.double()] * (self.width // self.b))

    def forward(self, h):
        shape = h.shape
        return torch.matmul(h.reshape(*shape[:-1], self.width // self.b, self.b), self.right).reshape(shape)


def rotation_block(form: str | None) -> int | None:
    """The block order of a ``block<b>`` rotation form (form c), else None."""
    m = re.fullmatch(r"block(\d+)", form or "")
    return int(m.group(1)) if m else None


def stream_rotation_block(form: str | None) -> int | None:
    """The block order of a ``stream-block<b>`` rotation form (form d), else None."""
    m = re.fullmatch(r"stream-block(\d+)", form or "")
    return int(m.group(1)) if m else None


class RotatedInput(nn.Module):
    """A Linear whose input is rotated online first (the rotation's module carries the marker
    name, so its MatMuls keep FP32 in every recipe)."""

    def __init__(self, rotation: OnlineHadamard, linear: nn.Linear):
        super().__init__()
        setattr(self, ONLINE_ROTATION_MARKER, rotation)
        self.linear = linear

    def forward(self, h):
        return self.linear(getattr(self, ONLINE_ROTATION_MARKER)(h))


def rotate_every_linear_input(root: nn.Module, block: int | None = None) -> tuple[int, set[str]]:
    """Form (b) in place on any module tree: each ``nn.Linear`` becomes a ``RotatedInput`` whose
    weight absorbed a two-step Hadamard ``M`` of its input width, ``y = (x M)(W M)^T`` (exact; the
    norms, the residual stream and the biases are untouched); with ``block``, form (c): ``M`` is a
    Hadamard of that order inside each block of the input. Returns the count and the widths."""
    count, widths = 0, set()
    if block is not None:   # refused before any weight changes: an in-place rotation is never left half done
        for name, child in root.named_modules():
            if isinstance(child, nn.Linear) and child.in_features % block:
                raise ConfigError(f"a block rotation of {block} needs every Linear's input width to be a multiple of "
                                  f"{block}; {name} reads {child.in_features}: choose a block that divides it")
    with torch.no_grad():
        for module in list(root.modules()):
            for child_name, child in list(module.named_children()):
                if not isinstance(child, nn.Linear) or isinstance(module, RotatedInput):
                    continue
                if block is None:
                    a, b = split_for_online(child.in_features)
                    online = OnlineHadamard(a, b)
                else:
                    online = BlockHadamard(child.in_features, block)
                    a, b = child.in_features // block, block
                m = online.matrix()
                child.weight.data = by_row_blocks(child.weight, lambda rows, m=m: rows @ m)
                setattr(module, child_name, RotatedInput(online, child))
                count += 1
                widths.add(f"{child.in_features}={a}x{b}")
    return count, widths


def online_plan(d_model: int, count: int, widths: set[str], layers: int, untied: bool,
                block: int | None = None) -> RotationPlan:
    what = "Hadamard before every Linear" if block is None else f"Hadamard inside each block of {block} before every Linear"
    return RotationPlan(d_model, "none (the residual stream is not rotated)",
                        f"{what} ({count} Linears; widths {', '.join(sorted(widths))})", layers, untied)


def rotate_linear_inputs(wrapper, spec=None, *, in_place: bool = False, block: int | None = None):
    """Form (b): every Linear's input rotated online, ``y = (x M)(W M)^T``, exact for any
    placement (nothing is folded, the residual stream is untouched). Each Linear of the model gets
    a two-step Hadamard ``M`` of its input width before it; a head tied to the embedding is untied
    (only the head's copy is rotated). Costs ``a + b`` MACs per input element per Linear (``block``:
    form c, ``block`` MACs). A deep copy, or with ``in_place`` ``wrapper`` itself."""
    rotated = wrapper if in_place else copy.deepcopy(wrapper)
    lm = rotated.model
    # The output embedding wherever the model keeps it (``lm_head``, BERT's MLM decoder): rotating a
    # head that shares its weight with the token embedding would rotate the embedding too.
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else getattr(lm, "lm_head", None)
    embed = lm.get_input_embeddings() if hasattr(lm, "get_input_embeddings") else None
    untied = False
    if head is not None and embed is not None and head.weight.data_ptr() == embed.weight.data_ptr():
        head.weight = nn.Parameter(embed.weight.detach().clone())
        lm.config.tie_word_embeddings = False
        untied = True
    count, widths = rotate_every_linear_input(lm, block)
    d = int(getattr(lm.config, "hidden_size", 0) or 0)
    layers = len(getattr(lm.base_model, spec.layers if spec else "layers", []) or [])
    return rotated.eval(), online_plan(d, count, widths, layers, untied, block)


# ---------------------------------------------------------------------------------------------
# Export, with parity against the original


@dataclass(frozen=True)
class RotatedExport:
    path: Path
    plan: RotationPlan
    export: object
    onnx_vs_original_max_rel_diff: float

    def to_dict(self, run_dir: Path | None = None) -> dict:
        return {**self.plan.to_dict(), "path": Path(self.path).name, "export": self.export.to_dict(run_dir),
                "onnx_vs_original_max_rel_diff": self.onnx_vs_original_max_rel_diff,
                "parity_rule": "max |delta| / max(1, max |original|) per output, max over outputs"}


def rotated_copy(loaded, wrapper, form: str = "hadamard", *, in_place: bool = False):
    """(rotated deep copy of a checkpoint's ``wrapper``, plan): form (a) "hadamard", (b) "online",
    (c) "block<b>" or (d) "stream-block<b>"; ``in_place``: ``wrapper`` itself rotated, for a caller
    that reloads the original weights."""
    if form == "hadamard" or stream_rotation_block(form) is not None:
        return rotate_wrapper(wrapper, loaded.spec, in_place=in_place, block=stream_rotation_block(form))
    return rotate_linear_inputs(wrapper, loaded.spec, in_place=in_place, block=rotation_block(form))


def rotate_and_export(loaded, wrapper, parity_inputs: np.ndarray, out_path: Path, *, outputs, max_positions,
                      opset: int, tolerance: float = DEFAULT_PARITY_TOLERANCE, form: str = "hadamard",
                      reload_original=None) -> RotatedExport:
    """The rotated export of a checkpoint's ``wrapper``, checked against its own module, then against
    the original's outputs. ``reload_original``: a callable giving the original wrapper again (the
    checkpoint reloaded); with it ``wrapper`` is rotated in place, so the export never holds the
    original and its rotated copy at once (Gemma 3: 1.1 GB and 1.7 GB with its untied head)."""
    rotated, plan = rotated_copy(loaded, wrapper, form, in_place=reload_original is not None)
    exported = export_module_onnx(rotated, out_path, parity_inputs, outputs=outputs, max_positions=max_positions,
                                  opset=opset)
    del rotated   # the rotated module is not read by the second gate
    if reload_original is not None:
        wrapper = reload_original()
    release_memory()
    diff = check_matches_original(wrapper, out_path, parity_inputs, what="rotated", tolerance=tolerance)
    return RotatedExport(Path(out_path), plan, exported, diff)


ROTATED_ONNX_FILE = "model.fp32.rotated.onnx"


def rotated_onnx_file(form: str) -> str:
    """The file a rotated export of ``form`` is written to (the Hadamard stream rotation keeps the plain name)."""
    return ROTATED_ONNX_FILE if form == "hadamard" else ROTATED_ONNX_FILE.replace("rotated", f"rotated-{form}")


def online_rotated_copy(model, block: int | None = None):
    """(a zoo model's deep copy with every Linear's input rotated online, count, widths); ``block``:
    form (c), a Hadamard inside each block of that order."""
    rotated = copy.deepcopy(model).eval()
    count, widths = rotate_every_linear_input(rotated, block)
    return rotated, count, widths


def export_online_rotated(model, parity_inputs: np.ndarray, out_path: Path, *, opset: int,
                          tolerance: float = DEFAULT_PARITY_TOLERANCE, block: int | None = None) -> RotatedExport:
    """Form (b) of the rotation on a zoo model (every Linear's input rotated in the graph; exact for
    every placement, the head is already untied) and its export, checked twice: the ONNX file against
    the rotated torch model (the export's own gate), then against the *original* model's logits,
    relative to their scale (the INT8 model is judged against the original). A failure keeps no file."""
    rotated, count, widths = online_rotated_copy(model, block)
    out_path = Path(out_path)
    exported = export_onnx(rotated, out_path, parity_inputs, opset=opset)
    diff = check_matches_original(model, out_path, parity_inputs, what="rotated", tolerance=tolerance, batch_size=16)
    plan = online_plan(model.cfg.d_model, count, widths, model.cfg.n_layers, untied=False, block=block)
    return RotatedExport(out_path, plan, exported, diff)
