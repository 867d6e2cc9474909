"""The ``[model]`` section: the transformer's shape and what follows from it (head width,
parameter counts, training FLOPs per token)."""

import math
from dataclasses import dataclass

from oases.config.checks import _check, _divisible, _positive


def format_params(n: float) -> str:
    """A parameter count as people read it: ``5.04 B``, ``124.44 M``, ``0.14 M``, ``3,072``
    (never ``0.00 B``): what ``oases train``, ``plan`` and ``simulate`` print."""
    if n >= 1e9:
        return f"{n / 1e9:.2f} B"
    if n >= 1e4:
        return f"{n / 1e6:.2f} M"
    return f"{int(n):,}"


@dataclass
class ModelConfig:
    """Transformer shape; ``n_kv_heads`` and ``ffn_dim`` default from the other fields."""

    arch: str = "gpt2"
    n_layers: int = 2
    dim: int = 64
    n_heads: int = 4
    n_kv_heads: int | None = None
    ffn_dim: int | None = None
    vocab_size: int = 256
    seq_len: int = 64
    dropout: float = 0.0
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02
    init_from: str = ""  # "" or "hf:PATH": shape and weights from a Hugging Face directory

    def __post_init__(self) -> None:
        _check(
            self.init_from == "" or (self.init_from.startswith("hf:") and len(self.init_from) > 3),
            f"model.init_from={self.init_from!r} must be '' or hf:PATH",
        )
        _check(self.arch in ("gpt2", "llama"), f"model.arch={self.arch!r} must be gpt2 or llama")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.ffn_dim is None:
            if self.arch == "gpt2":
                self.ffn_dim = 4 * self.dim
            else:
                self.ffn_dim = math.ceil(8 * self.dim / 3 / 64) * 64
        _positive("model", self, "n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim")
        _positive("model", self, "vocab_size", "seq_len", "norm_eps", "rope_theta", "init_std")
        _divisible("model.dim", self.dim, "model.n_heads", self.n_heads)
        _divisible("model.n_heads", self.n_heads, "model.n_kv_heads", self.n_kv_heads)
        _check(0.0 <= self.dropout < 1.0, f"model.dropout={self.dropout} must be in [0, 1)")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads

    def block_params(self) -> int:
        """Parameters of one transformer block (attention, MLP and their two norms)."""
        d, f, gpt2 = self.dim, self.ffn_dim, self.arch == "gpt2"
        qkv_out = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        if gpt2:  # biases everywhere; LayerNorm has weight and bias
            return (d * qkv_out + qkv_out) + (d * d + d) + (d * f + f) + (f * d + d) + 2 * (2 * d)
        # llama: no biases, fc1 rows are [gate | up], RMSNorm has a weight only
        return d * qkv_out + d * d + d * 2 * f + f * d + 2 * d

    def non_embedding_params(self) -> int:
        """Parameters outside the token/position embeddings and the head: blocks + final norm."""
        final_norm = 2 * self.dim if self.arch == "gpt2" else self.dim
        return self.n_layers * self.block_params() + final_norm

    def num_params(self) -> int:
        """Total distinct parameters of the unsharded model (a tied head is counted once)."""
        total = self.non_embedding_params() + self.vocab_size * self.dim  # embed.weight
        if self.arch == "gpt2":
            total += self.seq_len * self.dim  # pos_embed.weight
        if not self.tie_embeddings:
            total += self.vocab_size * self.dim  # head.weight, no bias
        return total

    def flops_per_token(self) -> float:
        """Training (forward + backward) FLOPs per token, Kaplan et al. (2020) style.

        ``6 * N`` for the matmuls, where N is the block and final-norm parameters plus the
        ``vocab_size * dim`` head matmul (counted even when tied; embedding lookups are free),
        plus ``6 * n_layers * seq_len * dim`` for the attention score and value products (the
        Kaplan estimate: the causal average of the full ``12 * n_layers * seq_len * dim``).
        """
        n = self.non_embedding_params() + self.vocab_size * self.dim
        return float(6 * n + 6 * self.n_layers * self.seq_len * self.dim)
