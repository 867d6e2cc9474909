"""Autoregressive sampling from a trained model, single-device or tensor-parallel.

Shape legend: B batch (prompts), P prompt length, N new tokens, S context (``model.seq_len``),
V vocabulary.

Each step runs the model on the last (at most) S tokens, takes the full-vocabulary logits of the
last position (``model(tokens)`` gathers them under TP, so every TP rank holds the same [B, V]),
and picks the next token: argmax when ``temperature == 0``, else a draw from
``softmax(logits / temperature)`` restricted to the ``top_k`` largest logits.

Under TP every rank of the group must feed the *same* next token to the next step, or the ranks'
activations diverge. The draws therefore come only from an explicit ``torch.Generator`` that the
caller seeds identically on every rank (``sampling_generator(seed)``); the global RNG state is
never read or advanced, so sampling in the middle of a run does not change training's random
stream. No KV cache: the context is re-run each step, which is fine for a short sample.

Under a mixed-degree plan the batch changes size between regions (gathered where the TP degree
grows, sliced where it shrinks): sample from one prompt, run as ``replicas`` identical rows so
that every slice keeps a whole row; the head's first row picks the token for all of them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from oases.precision import upcast


def sampling_generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``: build it the same way on every rank."""
    return torch.Generator(device="cpu").manual_seed(seed)


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def next_token(
    logits: Tensor,
    *,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator | None,
) -> Tensor:
    """logits [B, V] -> next tokens [B, 1] int64 (on the logits' device)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    scaled = upcast(logits) / temperature  # [B, V], at least fp32
    if top_k is not None and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]  # [B, 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)  # [B, V]
    if generator is None:
        # a private generator: never touch the global RNG state
        generator = sampling_generator(0)
    draw = torch.multinomial(probs.to(generator.device), 1, generator=generator)  # [B, 1]
    return draw.to(logits.device)


def generate(
    model: nn.Module,
    prompt_tokens: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int | None = 40,
    generator: torch.Generator | None = None,
    replicas: int = 1,
) -> Tensor:
    """Prompt [B, P] (or [P]) int -> [B, P + N] int64: the prompt followed by N = max_new_tokens
    sampled tokens (on the model's device).

    ``temperature == 0`` is greedy (argmax); ``top_k=None`` samples from the whole vocabulary.
    ``generator`` drives the draws (on TP, seed it identically on every rank; on CUDA a CPU
    generator works: the probabilities are moved to its device for the draw). Without one, a
    generator seeded with 0 is used, never the global RNG. Runs under ``torch.no_grad`` in eval
    mode and restores the model's train/eval mode afterwards. ``replicas`` > 1 (a one-row prompt
    under a mixed-degree plan, see above): the prompt runs as that many identical rows.
    """
    if prompt_tokens.dim() == 1:
        prompt_tokens = prompt_tokens.unsqueeze(0)  # [1, P]
    if prompt_tokens.dim() != 2 or prompt_tokens.shape[1] < 1:
        raise ValueError(
            f"prompt_tokens must have shape [B, P] with P >= 1, got {tuple(prompt_tokens.shape)}"
        )
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1 or None")
    if replicas < 1 or (replicas > 1 and prompt_tokens.shape[0] != 1):
        raise ValueError(
            f"replicas={replicas} must be >= 1, and 1 for a batch of "
            f"{prompt_tokens.shape[0]} prompts"
        )
    S = model.cfg.seq_len
    tokens = prompt_tokens.to(_model_device(model), dtype=torch.long)  # [B, P]
    tokens = tokens.expand(replicas, -1) if replicas > 1 else tokens  # [replicas, P]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for _ in range(max_new_tokens):
                context = tokens[:, -S:]  # [B, min(P + n, S)]
                logits = model(context)[:, -1, :]  # [B, V]
                if prompt_tokens.shape[0] == 1:  # a mixed plan's head may hold several copies
                    logits = logits[:1]
                nxt = next_token(
                    logits, temperature=temperature, top_k=top_k, generator=generator
                )  # [B, 1]
                tokens = torch.cat([tokens, nxt.expand(tokens.shape[0], -1)], dim=1)  # [B, P+n+1]
    finally:
        model.train(was_training)
    return tokens[:1] if replicas > 1 else tokens
