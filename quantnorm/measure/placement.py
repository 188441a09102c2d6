"""Placement and norm read from the FP32 ONNX graph, for any architecture.

Why the graph: it is what every source becomes after export (zoo, Hugging Face, GGUF), and its
dataflow says where the normalizations sit relative to the residual additions whatever the
modules are called (HF's ``post_attention_layernorm`` is a pre-MLP norm in LLaMA and an
attention-output norm in Gemma). The detector walks the residual stream from the token embedding:

- a *norm* is a native ``LayerNormalization`` / ``RMSNormalization`` node, or the decomposed form
  the exporter writes at opset 18: ``ReduceMean(x^2)`` (after ``x - mean(x)`` for LayerNorm), the
  ``sqrt``/reciprocal, ``x *`` it, then any per-channel weight (``w``, ``1 + w``, a bias);
- a *residual add* is an ``Add`` of the stream and a non-constant branch output;
- per residual add: the norm reads the stream before the branch (**pre**), the branch output is a
  norm output (**peri** with an input norm; **output-norm** without, as OLMo 2), or the sum is
  normalized and the norm's output is the next stream (**post**; **deepnorm** when the skip is
  scaled by a constant first). A second add whose branch hangs off the norm of the previous stream
  is **parallel** (GPT-NeoX, Phi: attention and MLP read one normed input).

The result is a label per residual add, the majority placement with how many adds agree, the
norm kind and whether a final norm stands before the head. An architecture whose graph shows no
residual add from the embedding gets ``placement = None`` and says what was found.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import onnx

NATIVE_NORMS = {"LayerNormalization": "layer", "RMSNormalization": "rms", "SimplifiedLayerNormalization": "rms"}
PASS_THROUGH = ("Cast", "Identity")
MAX_ADDS = 4096


@dataclass
class Norm:
    input: str
    output: str
    kind: str            # "layer" | "rms"
    how: str             # "native <op>" | "decomposed"


@dataclass
class GraphPlacement:
    placement: str | None
    norm: str | None
    how: str
    labels: list[str] = field(default_factory=list)
    final_norm: bool = False
    # The residual stream as graph tensors, for the graph probe (not in to_dict): the stream the
    # first block reads, then per residual add its sum, the stream after it (the sum itself, or
    # the norm's output in post/deepnorm stacks) and the branch (sublayer) output it adds.
    embedding: str | None = None
    taps: list[tuple[str, str, str]] = field(default_factory=list)  # (sum, stream after, branch) per label
    skips: list[str | None] = field(default_factory=list)  # ResiDual's x_d after each add (else empty)

    def to_dict(self) -> dict:
        counts = Counter(self.labels)
        return {"placement": self.placement, "norm": self.norm, "how": self.how,
                "residual_adds": len(self.labels), "labels": dict(counts), "final_norm": self.final_norm}


class _Graph:
    def __init__(self, model: onnx.ModelProto):
        g = model.graph
        self.nodes = list(g.node)
        self.consts = {i.name for i in g.initializer}
        self.consts |= {n.output[0] for n in self.nodes if n.op_type == "Constant"}
        self.producer = {o: n for n in self.nodes for o in n.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in self.nodes:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
        self.inputs = [i.name for i in g.input]

    def is_const(self, name: str) -> bool:
        return name in self.consts or name == ""

    def source(self, name: str) -> str:
        """Back through Cast/Identity to the tensor they copy."""
        seen = 0
        while seen < 16:
            node = self.producer.get(name)
            if node is None or node.op_type not in PASS_THROUGH:
                return name
            name, seen = node.input[0], seen + 1
        return name

    def uses(self, name: str) -> list[onnx.NodeProto]:
        """Consumers of ``name`` and of its Cast/Identity copies."""
        out, todo = [], [name]
        while todo:
            t = todo.pop()
            for n in self.consumers.get(t, []):
                if n.op_type in PASS_THROUGH:
                    todo.append(n.output[0])
                else:
                    out.append(n)
        return out


def find_norms(model: onnx.ModelProto) -> list[Norm]:
    g = _Graph(model)
    norms: list[Norm] = []
    for node in g.nodes:
        if node.op_type in NATIVE_NORMS:
            norms.append(Norm(g.source(node.input[0]), node.output[0], NATIVE_NORMS[node.op_type], f"native {node.op_type}"))
    for node in g.nodes:
        if node.op_type != "ReduceMean":
            continue
        sq = g.producer.get(node.input[0])
        if sq is None:
            continue
        if sq.op_type == "Pow" and g.is_const(sq.input[1]):
            base = sq.input[0]
        elif sq.op_type == "Mul" and sq.input[0] == sq.input[1]:
            base = sq.input[0]
        else:
            continue
        kind, origin = "rms", g.source(base)
        centered = g.producer.get(base)
        if centered is not None and centered.op_type == "Sub":
            mean = g.producer.get(centered.input[1])
            if mean is not None and mean.op_type == "ReduceMean" and g.source(mean.input[0]) == g.source(centered.input[0]):
                kind, origin = "layer", g.source(centered.input[0])
        out = _normalized_output(g, node.output[0], base)
        if out is not None:
            norms.append(Norm(origin, _after_affine(g, out), kind, "decomposed"))
    return norms


def _normalized_output(g: _Graph, stat: str, base: str) -> str | None:
    """From ``mean(x^2)`` forward through eps/sqrt/reciprocal to the Mul or Div that scales ``x``."""
    frontier, depth = [stat], 0
    while frontier and depth < 6:
        nxt = []
        for t in frontier:
            for n in g.uses(t):
                ins = [g.source(i) for i in n.input]
                if n.op_type in ("Mul", "Div") and g.source(base) in ins:
                    return n.output[0]
                if n.op_type in ("Add", "Sqrt", "Reciprocal", "Div", "Max", "Pow", "Mul") and n.output:
                    nxt.append(n.output[0])
        frontier, depth = nxt, depth + 1
    return None


def _after_affine(g: _Graph, t: str) -> str:
    """Past the norm's per-channel weight and bias (Mul/Add by a constant or a function of one,
    e.g. Gemma's ``1 + w``), while the chain is the tensor's only use."""
    for _ in range(4):
        uses = g.uses(t)
        if len(uses) != 1 or uses[0].op_type not in ("Mul", "Add"):
            return t
        node = uses[0]
        other = [i for i in node.input if g.source(i) != g.source(t)]
        if not other or not _constant_expression(g, other[0]):
            return t
        t = node.output[0]
    return t


def _constant_expression(g: _Graph, name: str, depth: int = 3, shapes: bool = False) -> bool:
    """``name`` is computed from constants only; with ``shapes``, from tensor shapes too (a padding
    mask of ones the model builds from the input's shape does not depend on its values)."""
    if g.is_const(name):
        return True
    node = g.producer.get(name)
    if shapes and node is not None and node.op_type == "Shape":
        return True
    if node is None or depth == 0:
        return False
    return all(_constant_expression(g, i, depth - 1, shapes) for i in node.input if i)


def _embedding_output(g: _Graph) -> str | None:
    ids = set(g.inputs)

    def from_ids(t: str, depth: int = 8) -> bool:
        """``t`` is the token ids themselves, maybe reshaped or cast (not their shape)."""
        if t in ids:
            return True
        node = g.producer.get(t)
        if node is None or depth == 0 or node.op_type not in ("Reshape", "Cast", "Identity", "Unsqueeze",
                                                               "Squeeze", "Flatten"):
            return False
        return from_ids(node.input[0], depth - 1)

    for node in g.nodes:
        if node.op_type == "Gather" and g.is_const(node.input[0]) and from_ids(node.input[1]):
            t = node.output[0]
            # past a constant scale (Gemma multiplies the embedding by sqrt(d)) and added position or
            # token-type embeddings (GPT-2, BERT, the zoo): Adds of another table lookup
            for _ in range(4):
                uses = g.uses(t)
                if len(uses) != 1 or uses[0].op_type not in ("Mul", "Add"):
                    break
                other = [i for i in uses[0].input if g.source(i) != g.source(t)]
                if not other or not (_constant_expression(g, other[0]) or _is_lookup(g, other[0])):
                    break
                t = uses[0].output[0]
            return t
    return None


def _two_branches_of(g: _Graph, branch: str, normed: str) -> bool:
    node = g.producer.get(g.source(branch))
    if node is None or node.op_type != "Add" or any(g.is_const(i) for i in node.input):
        return False
    return all(_descends_from(g, g.source(i), g.source(normed), limit=2000) for i in node.input)


def _feeds_residual_add(g: _Graph, t: str) -> bool:
    """``t`` goes into an Add directly, or scaled by a constant first (DeepNorm's alpha * x)."""
    for n in g.uses(t):
        if n.op_type == "Add":
            return True
        if n.op_type == "Mul" and any(_constant_expression(g, i) for i in n.input if g.source(i) != t) and \
                any(m.op_type == "Add" for m in g.uses(n.output[0])):
            return True
    return False


def _is_lookup(g: _Graph, name: str) -> bool:
    """A Gather of a constant table, maybe reshaped (a position or token-type embedding)."""
    for _ in range(6):
        node = g.producer.get(name)
        if node is None:
            return False
        if node.op_type == "Gather":
            return g.is_const(node.input[0])
        if node.op_type not in ("Unsqueeze", "Reshape", "Expand", "Cast", "Identity", "Squeeze"):
            return False
        name = node.input[0]
    return False


def _descends_from(g: _Graph, tensor: str, ancestor: str, limit: int = 400) -> bool:
    seen, todo = set(), [tensor]
    while todo and len(seen) < limit:
        t = todo.pop()
        if t == ancestor:
            return True
        if t in seen:
            continue
        seen.add(t)
        node = g.producer.get(t)
        if node is not None:
            todo.extend(i for i in node.input if i and not g.is_const(i))
    return False


def detect_placement(model_or_path) -> GraphPlacement:
    """Walk the residual stream from the token embedding, one residual add a step (``_Walk``), and
    read the placement off the labels (see the module doc)."""
    model = onnx.load(str(model_or_path), load_external_data=False) if isinstance(model_or_path, (str, Path)) \
        else model_or_path
    g = _Graph(model)
    norms = find_norms(model)
    stream = _embedding_output(g)
    if stream is None:
        return GraphPlacement(None, None, f"no token embedding (Gather of a constant table by an input) found; "
                                          f"{len(norms)} norms in the graph")
    walk = _Walk(g, norms)
    for _ in range(MAX_ADDS):
        stream = walk.step(stream)
        if stream is None:
            break
    return walk.result(norms)


class _Walk:
    """The state of the walk: a label, the taps and the ResiDual skip per residual add, the norm
    kinds met, and whether a final norm stands before the head."""

    def __init__(self, g: _Graph, norms: list[Norm]):
        self.g = g
        self.by_input: dict[str, list[Norm]] = {}
        for n in norms:
            self.by_input.setdefault(n.input, []).append(n)
        self.outputs = {g.source(n.output): n for n in norms}
        self.labels: list[str] = []
        self.taps: list[tuple[str, str, str]] = []
        self.skips: list[str | None] = []
        self.embedding: str | None = None
        self.skip_stream: str | None = None   # ResiDual's x_d, once found
        self.kinds: Counter = Counter()
        self.previous_norm: Norm | None = None
        self.final = False

    def step(self, stream: str) -> str | None:
        """Label the residual add that reads ``stream``; the stream after it, or None: the walk ends."""
        g = self.g
        s = g.source(stream)
        reading = self.by_input.get(s, [])
        adds, scaled = _adds_reading(g, s)
        if not adds:
            after_norm = self._embedding_norm(reading)
            if after_norm is not None:
                return after_norm
            self.final = bool(reading)
            if reading:
                self.kinds[reading[0].kind] += 1
            return None
        # Two adds read the stream where one branch output is added to two streams (ResiDual: x_a
        # and x_d both start as the embedding): follow the one whose sum is normalized, x_a.
        add = next((a for a in adds if self.by_input.get(g.source(a.output[0]))), adds[0])
        branch = next((i for i in add.input if g.source(i) != s and not _descends_scale(g, i, s)), add.input[-1])
        branch_norm = self.outputs.get(g.source(branch))
        if branch_norm is not None and self.skip_stream is not None and \
                g.source(branch_norm.input) == g.source(self.skip_stream):
            self.final = True  # ResiDual's readout x_a + N(x_d): not a residual add of a block
            self.kinds[branch_norm.kind] += 1
            return None
        label, nxt = self._classify(add, branch, branch_norm, reading, scaled)
        self.previous_norm = reading[0] if reading else self.previous_norm
        if not self.labels:
            self.embedding = stream
        self.labels.append(label)
        self.taps.append((add.output[0], nxt, branch))
        self.skips.append(self.skip_stream if label == "residual" else None)
        return None if label == "last" else nxt

    def _embedding_norm(self, reading: list[Norm]) -> str | None:
        """Before the first block, a norm of the embeddings (BERT), maybe times the padding mask
        (DeBERTa): the stream after it, when a residual add reads that."""
        if self.labels or not reading:
            return None
        after = _past_mask(self.g, reading[0].output)
        return after if _adds_directly(self.g, after) else None

    def _classify(self, add, branch: str, branch_norm: Norm | None, reading: list[Norm],
                  scaled: bool) -> tuple[str, str]:
        """(label, stream after) of one residual add."""
        g = self.g
        after = add.output[0]
        post_norm = self.by_input.get(g.source(after), [])
        sum_feeds_add = _adds_directly(g, after)
        skip_add = next((n for n in g.uses(g.source(branch)) if n.op_type == "Add" and n is not add), None)
        if post_norm and (skip_add is not None or (sum_feeds_add and _adds_directly(g, post_norm[0].output))):
            # ResiDual: the branch output goes to two streams, x_a = N(x_a + f) and x_d = x_d + f.
            # Its first sublayer's two sums are one tensor (both streams start as the embedding,
            # and the exporter computes emb + f once): the sum is x_d and its norm x_a.
            self.kinds[post_norm[0].kind] += 1
            self.skip_stream = skip_add.output[0] if skip_add is not None else after
            return "residual", post_norm[0].output
        if post_norm and not sum_feeds_add:
            # The sum is normalized and only the norm reads it: post, unless this is the last add of
            # a pre/peri stack (its sum goes to the final norm and then the head): told apart in result.
            self.kinds[post_norm[0].kind] += 1
            nxt = post_norm[0].output
            if not _feeds_residual_add(g, g.source(nxt)):
                return "last", nxt
            return ("deepnorm" if scaled else "post"), nxt
        for nm in reading[:1] + ([branch_norm] if branch_norm else []):
            self.kinds[nm.kind] += 1
        return self._sum_label(branch, branch_norm, reading), after

    def _sum_label(self, branch: str, branch_norm: Norm | None, reading: list[Norm]) -> str:
        """An add whose sum is the next stream: where the norms stand around the branch."""
        g = self.g
        if len(reading) >= 2 or (reading and _two_branches_of(g, branch, reading[0].output)):
            # attention and MLP side by side on the stream: two norms read it, or one norm's
            # output feeds both sublayers whose outputs are summed before the add (GPT-NeoX, Phi)
            return "parallel"
        if reading:
            return "peri" if branch_norm is not None else "pre"
        if branch_norm is not None:
            return "output-norm"
        if self.previous_norm is not None and _descends_from(g, g.source(branch), self.previous_norm.output):
            return "parallel"
        return "none"

    def result(self, norms: list[Norm]) -> GraphPlacement:
        """The majority placement over the labels, the norm kind and how it was read."""
        counts = Counter(x for x in self.labels if x != "last")
        if self.labels and self.labels[-1] == "last":
            self._close_last(counts)
        if not counts:
            return GraphPlacement(None, None, f"no residual add on the stream from the embedding; {len(norms)} norms")
        placement = "parallel" if counts.get("parallel") else counts.most_common(1)[0][0]
        norm = self.kinds.most_common(1)[0][0] if self.kinds else None
        n_agree = counts[placement] + (counts["pre"] if placement == "parallel" else 0)
        how = (f"ONNX graph: {len(self.labels)} residual adds walked from the embedding, {n_agree} read as "
               f"{placement} ({', '.join(f'{k} {v}' for k, v in counts.most_common())}); norms: "
               f"{', '.join(f'{k} {v}' for k, v in self.kinds.most_common()) or 'none'} "
               f"({Counter(n.how for n in norms).most_common(1)[0][0] if norms else 'none found'}); "
               f"final norm before the head: {'yes' if self.final else 'no'}")
        return GraphPlacement(placement if placement != "none" else None, norm, how, self.labels, self.final,
                              self.embedding, self.taps, self.skips if any(self.skips) else [])

    def _close_last(self, counts: Counter) -> None:
        """The last sum goes through one norm to the head: a final norm in a pre/peri/output-norm
        stack, the last block's own norm in a post stack."""
        majority = counts.most_common(1)[0][0] if counts else "post"
        if majority not in ("post", "deepnorm"):
            self.final = True
            self.taps[-1] = (self.taps[-1][0], self.taps[-1][0], self.taps[-1][2])  # the sum is the stream
        self.labels[-1] = majority
        counts[majority] += 1


def _adds_reading(g: _Graph, s: str) -> tuple[list, bool]:
    """The residual adds reading the stream ``s``, and whether the skip is scaled first (DeepNorm)."""
    adds, scaled = [], False
    for n in g.uses(s):
        if n.op_type == "Add" and not any(g.is_const(i) for i in n.input):
            adds.append(n)
        elif n.op_type == "Mul" and any(_constant_expression(g, i) for i in n.input if g.source(i) != s):
            adds += [m for m in g.uses(n.output[0]) if m.op_type == "Add"]
            scaled = bool(adds)
    return adds, scaled


def _past_mask(g: _Graph, t: str) -> str:
    """Past a Mul by a data-independent tensor (a padding mask of ones built from the input's shape)."""
    uses = g.uses(t)
    if len(uses) == 1 and uses[0].op_type == "Mul":
        other = [i for i in uses[0].input if g.source(i) != g.source(t)]
        if other and _constant_expression(g, other[0], depth=6, shapes=True):
            return uses[0].output[0]
    return t


def _adds_directly(g: _Graph, tensor: str) -> bool:
    """``tensor`` is itself a residual stream: an Add of it and a non-constant reads it."""
    return any(n.op_type == "Add" and not any(g.is_const(i) for i in n.input) for n in g.uses(g.source(tensor)))


def _descends_scale(g: _Graph, tensor: str, stream: str) -> bool:
    """``tensor`` is ``const * stream`` (DeepNorm's scaled skip)."""
    node = g.producer.get(g.source(tensor))
    return node is not None and node.op_type == "Mul" and stream in [g.source(i) for i in node.input]

