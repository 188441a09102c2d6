"""Tiny GGUF files written with the ``gguf`` package's writer (nothing downloaded).

Llama layout: the tensor names, metadata keys and a byte-level BPE vocabulary (tokens, types and
merges) that transformers' GGUF loader needs. Weights are random F32; the loader dequantizes and
un-permutes Q/K as it does for a real file, so what it builds is an ordinary LlamaForCausalLM.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def byte_level_vocab() -> tuple[list[str], list[str]]:
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = ["<unk>", "<s>", "</s>"] + alphabet + ["Ġt", "he", "Ġthe", "in", "Ġa"]
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
    return tokens, merges


def write_tiny_llama_gguf(path: Path, *, d: int = 32, ff: int = 64, layers: int = 2, heads: int = 4, kv: int = 2,
                          seed: int = 0, massive: tuple[int, float] | None = None) -> Path:
    """A 2-block Llama GGUF. ``massive=(channel, value)`` plants a huge embedding entry in one
    channel of the BOS token, as a stand-in for a real model's massive activation."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens, merges = byte_level_vocab()
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(d)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * vocab)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def r(*shape, scale=0.1):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    embed = r(vocab, d)
    if massive is not None:
        embed[1, massive[0]] = massive[1]
    w.add_tensor("token_embd.weight", embed)
    hd = d // heads
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", (1 + r(d)).astype(np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", r(d, d))
        w.add_tensor(f"blk.{i}.attn_k.weight", r(kv * hd, d))
        w.add_tensor(f"blk.{i}.attn_v.weight", r(kv * hd, d))
        w.add_tensor(f"blk.{i}.attn_output.weight", r(d, d))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + r(d)).astype(np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", r(ff, d))
        w.add_tensor(f"blk.{i}.ffn_up.weight", r(ff, d))
        w.add_tensor(f"blk.{i}.ffn_down.weight", r(d, ff))
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def write_tiny_gemma3_gguf(path: Path, *, d: int = 32, ff: int = 64, layers: int = 2, heads: int = 4, kv: int = 2,
                           hd: int = 8, seed: int = 0) -> Path:
    """A 2-block Gemma 3 GGUF: QK-norm, four norms per block stored as ``1 + w`` (as llama.cpp writes
    them; the loader subtracts the 1), a SentencePiece-style vocabulary with byte fallback."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "gemma3")
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{i:02X}>" for i in range(256)] + ["▁t", "he", "▁the", "▁a"]
    vocab = len(tokens)
    w.add_context_length(128)
    w.add_embedding_length(d)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_sliding_window(64)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 4 + [-1000.0] * 256 + [-1.0, -2.0, -3.0, -4.0])
    w.add_token_types([3, 3, 3, 2] + [6] * 256 + [1] * 4)  # control, unknown, bytes, normal
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_pad_token_id(0)
    w.add_unk_token_id(3)

    def r(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    def one(n):  # GGUF stores Gemma's norm weights as 1 + w
        return (1 + r(n)).astype(np.float32)

    w.add_tensor("token_embd.weight", r(vocab, d))
    for i in range(layers):
        for name, t in [("attn_norm", one(d)), ("attn_q", r(heads*hd, d)), ("attn_k", r(kv*hd, d)), ("attn_v", r(kv*hd, d)),
                        ("attn_output", r(d, heads*hd)), ("attn_q_norm", one(hd)), ("attn_k_norm", one(hd)),
                        ("post_attention_norm", one(d)), ("ffn_norm", one(d)), ("ffn_gate", r(ff, d)), ("ffn_up", r(ff, d)),
                        ("ffn_down", r(d, ff)), ("post_ffw_norm", one(d))]:
            w.add_tensor(f"blk.{i}.{name}.weight", t)
    w.add_tensor("output_norm.weight", one(d))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def split_into_parts(path: Path, out_dir: Path, n: int = 3) -> list[Path]:
    """Raw byte parts ``<name>.part00`` ... as the Gemma 3 packages ship them."""
    data = Path(path).read_bytes()
    out_dir.mkdir(parents=True, exist_ok=True)
    step = -(-len(data) // n)
    parts = []
    for i in range(n):
        part = out_dir / f"{Path(path).name}.part{i:02d}"
        part.write_bytes(data[i * step:(i + 1) * step])
        parts.append(part)
    return parts
