"""Single-device GPT-2 and LLaMA decoders: plain PyTorch, no ``torch.distributed``.

Parallelism is applied from outside (``oases.parallel.apply.parallelize``) by module name, so every
module here is written so that replacing its linears by tensor-parallel ones keeps it correct:
attention reads its local head counts from attributes that ``parallelize`` divides by ``tp``.

Shape legend: B batch, S sequence, H hidden (dim), A query heads, K kv heads, D head dim,
F ffn dim, V vocabulary.

Block (pre-LN, Megatron layout)::

    x ─┬─ attn_norm ─ qkv ─ attention ─ proj ─ drop ─(+)─┬─ mlp_norm ─ fc1 ─ act ─ fc2 ─ drop ─(+)─▶
       └──────────────────────────────────────────────────┘└────────────────────────────────────┘

Parameter names (the contract for sharding, checkpoints and Hugging Face import):
``embed``, ``pos_embed`` (gpt2),
``blocks.{i}.{attn_norm,attn.qkv,attn.proj,mlp_norm,mlp.fc1,mlp.fc2}``,
``norm``, ``head`` (its weight *is* ``embed.weight`` when embeddings are tied). ``qkv`` rows are
``[Q | K | V]``; llama's ``fc1`` rows are ``[gate | up]``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from oases.config import ModelConfig
from oases.precision import to_activation, upcast


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` whose output is an activation (``to_activation``): under bf16
    autocast the statistics run in fp32 (autocast's rule for layer_norm) and the output is
    bf16, as the next matmul would cast it anyway; elsewhere ``nn.LayerNorm`` itself."""

    def forward(self, x: Tensor) -> Tensor:
        return to_activation(super().forward(x))


class RMSNorm(nn.Module):
    """Root-mean-square norm (LLaMA): ``x / rms(x) * weight``, computed in at least fp32; the
    output an activation (``to_activation``)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = upcast(x)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return to_activation(xf.type_as(x) * self.weight)


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin tables [S, D] for rotary embeddings in the rotate-half (Hugging Face) layout.

    Computed in fp32, as Hugging Face's LLaMA computes them in every dtype (``.double()``
    included), so an imported model sees the positions it was trained with; ``model.to(dtype)``
    casts the tables with the model and ``apply_rope`` uses them in at least fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)  # [S, D/2]
    angles = torch.cat([angles, angles], dim=-1)  # [S, D]
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [B, heads, S, D] by position: x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (upcast(x) * cos + upcast(rotated) * sin).type_as(x)


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads.

    ``n_heads`` / ``n_kv_heads`` are the heads *this module computes*: all of them on one
    device, ``A/tp`` and ``K/tp`` after ``parallelize``. ``core`` is everything before the
    output projection, so a schedule can run ``proj`` as a partial sum and reduce it itself.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        bias = cfg.arch == "gpt2"
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        qkv_out = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
        self.qkv = nn.Linear(cfg.dim, qkv_out, bias=bias)
        self.proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=bias)
        self.use_rope = cfg.arch == "llama"
        if self.use_rope:
            cos, sin = rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    def core(self, h: Tensor) -> Tensor:
        """[B, S, H] -> [B, S, A*D]: QKV projection, rotary, causal attention on local heads."""
        B, S, _ = h.shape
        A, K, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.qkv(h)  # [B, S, (A + 2K) * D]
        q, k, v = qkv.split([A * D, K * D, K * D], dim=-1)
        q = q.view(B, S, A, D).transpose(1, 2)  # [B, A, S, D]
        k = k.view(B, S, K, D).transpose(1, 2)  # [B, K, S, D]
        v = v.view(B, S, K, D).transpose(1, 2)  # [B, K, S, D]
        if self.use_rope:
            cos, sin = self.rope_cos[:S], self.rope_sin[:S]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if K != A:
            k = k.repeat_interleave(A // K, dim=1)  # [B, A, S, D]
            v = v.repeat_interleave(A // K, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, A, S, D]
        return o.transpose(1, 2).reshape(B, S, A * D)  # [B, S, A*D]

    def forward(self, h: Tensor) -> Tensor:
        return self.proj(self.core(h))


class MLP(nn.Module):
    """GPT-2: fc2(gelu(fc1 h)). LLaMA (SwiGLU): fc2(silu(gate) * up) with fc1 = [gate | up]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gated = cfg.arch == "llama"
        bias = not self.gated
        fc1_out = 2 * cfg.ffn_dim if self.gated else cfg.ffn_dim
        self.fc1 = nn.Linear(cfg.dim, fc1_out, bias=bias)
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=bias)

    def core(self, h: Tensor) -> Tensor:
        """[B, S, H] -> [B, S, F] (local F after parallelize)."""
        u = self.fc1(h)
        if self.gated:
            gate, up = u.chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(u, approximate="tanh")

    def forward(self, h: Tensor) -> Tensor:
        return self.fc2(self.core(h))


class Block(nn.Module):
    """One pre-LN transformer block: x + drop(attn(norm x)), then x + drop(mlp(norm x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        norm = LayerNorm if cfg.arch == "gpt2" else RMSNorm
        self.attn_norm = norm(cfg.dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = norm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        # Where a plan changes the TP degree, parallelize puts a batch reshard here.
        self.attn_reshard: nn.Module = nn.Identity()
        self.mlp_reshard: nn.Module = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        x = self.attn_reshard(x)
        x = x + self.drop(self.attn(self.attn_norm(x)))
        x = self.mlp_reshard(x)
        return x + self.drop(self.mlp(self.mlp_norm(x)))


class CrossEntropy(nn.Module):
    """Mean token cross-entropy over logits [B, S, V], in at least fp32. ``parallelize`` swaps
    in the vocab-parallel version, which never gathers the logits."""

    def forward(self, logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(upcast(logits.flatten(0, 1)), targets.flatten())


class Transformer(nn.Module):
    """Decoder-only language model. ``model(tokens)`` -> logits [B, S, V];
    ``model(tokens, targets)`` -> mean cross-entropy loss (a scalar)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embed = nn.Embedding(cfg.seq_len, cfg.dim) if cfg.arch == "gpt2" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = (
            LayerNorm(cfg.dim, eps=cfg.norm_eps)
            if cfg.arch == "gpt2"
            else RMSNorm(cfg.dim, eps=cfg.norm_eps)
        )
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # ``gather_logits`` is the identity here; under TP it gathers the vocabulary shards.
        self.gather_logits: nn.Module = nn.Identity()
        self.loss_fn: nn.Module = CrossEntropy()
        self.head_reshard: nn.Module = nn.Identity()  # reshard points of mixed-degree plans
        self.target_reshard: nn.Module = nn.Identity()
        self.recompute = False
        self.parallel_ctx = None  # set by oases.parallel.apply.parallelize
        self.parallel_plan = None
        self.reset_parameters()
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, init_std), residual projections scaled by 1/sqrt(2 * n_layers)."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif "norm" in name:
                nn.init.ones_(p)
            elif name.endswith(("proj.weight", "fc2.weight")):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.cfg.n_layers))
            else:
                nn.init.normal_(p, 0.0, std)

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        """tokens [B, S] -> x [B, S, H]: token (+ learned position) embedding, dropout; an
        activation (``to_activation``: bf16 under bf16 autocast), each term cast before the
        sum, as the vocab-parallel embedding's partial sums are."""
        S = tokens.shape[1]
        if self.cfg.seq_len < S:
            raise ValueError(f"sequence length {S} exceeds model.seq_len={self.cfg.seq_len}")
        x = to_activation(self.embed(tokens))
        if self.pos_embed is not None:
            x = x + to_activation(self.pos_embed.weight[:S])
        return self.drop(x)

    def forward(self, tokens: Tensor, targets: Tensor | None = None) -> Tensor:
        check_batch(self.cfg, tokens, targets)
        if self.recompute and self.parallel_ctx is not None:
            raise ValueError(
                "model.recompute is single-device activation checkpointing; a "
                "parallelized model recomputes through a schedule "
                "(megatron-recompute, commfree-recompute, oases)"
            )
        x = self.embed_tokens(tokens)
        for block in self.blocks:
            if self.recompute and torch.is_grad_enabled():
                # No early stop: the recompute re-runs the whole block, as Megatron's does.
                with set_checkpoint_early_stop(False):
                    x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        local_logits = self.head(self.norm(self.head_reshard(x)))  # [B, S, V] (V/tp shard)
        if targets is None:
            return self.gather_logits(local_logits)
        return self.loss_fn(local_logits, self.target_reshard(targets))


def check_batch(cfg: ModelConfig, tokens: Tensor, targets: Tensor | None = None) -> None:
    """ValueError unless tokens (and targets) are [B, S] ids in [0, vocab_size), S <= seq_len.
    (Out-of-range ids would otherwise look up nothing under vocabulary parallelism.) The ids are
    read only from host tensors: on a GPU, ``int(t.min())`` would wait for the device every
    step, so the training loop checks each batch on the host before moving it there."""
    for name, t in (("tokens", tokens), ("targets", targets)):
        if t is None:
            continue
        if t.dim() != 2 or t.shape[1] > cfg.seq_len:
            raise ValueError(
                f"{name} must be [batch, seq <= model.seq_len={cfg.seq_len}], "
                f"got shape {list(t.shape)}"
            )
        if t.device.type != "cpu":
            continue
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= cfg.vocab_size:
            raise ValueError(
                f"{name} ids must lie in [0, model.vocab_size={cfg.vocab_size}), got [{lo}, {hi}]"
            )
    if targets is not None and targets.shape != tokens.shape:
        raise ValueError(f"targets shape {list(targets.shape)} != tokens {list(tokens.shape)}")


def build_model(cfg: ModelConfig) -> Transformer:
    """Build the single-device model from its config (initialized with the current torch seed)."""
    return Transformer(cfg)


def count_params(model: nn.Module) -> int:
    """Number of distinct parameters (a tied weight counts once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
