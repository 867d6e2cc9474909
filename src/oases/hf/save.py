"""``save_hf`` / ``export_checkpoint``: an Oases model or checkpoint -> a directory that
transformers loads (``config.json`` in the HF format, ``model.safetensors`` with HF names and
layouts, fp32 or the dtype asked for: ``dtype`` "fp32" | "bf16" | "fp16", from the fp32 master
weights). ``export_checkpoint`` adds the run's tokenizer (``tokenizer.json`` and a
``tokenizer_config.json`` for ``AutoTokenizer``: the byte tokenizer as a byte-level BPE without
merges, or the run's BPE), and ``config.json``'s ``bos_token_id``/``eos_token_id`` are the
tokenizer's document separator. Files get the usual permissions (0666 less the umask).

Under TP every rank gathers each sharded parameter over its TP group (``comm.gather_from_tp``,
one parameter at a time; under a mixed-degree plan, the group of the parameter's region) and
rank 0 writes; the other ranks drop the full tensors at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from oases.config import ModelConfig
from oases.hf.convert import HF_DTYPES, config_to_hf, hf_pieces
from oases.hf.load import SINGLE_FILE, safetensors_module, user_input_errors
from oases.model import Transformer
from oases.parallel import comm
from oases.parallel.apply import parameter_degrees
from oases.parallel.context import Group, ParallelContext
from oases.parallel.layers import shard_spec, unshard_tensor
from oases.train.tokenizer import (
    HF_PREFIX,
    TOKENIZER_FILE,
    BPETokenizer,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    token_text,
    tokenizer_json,
)


def gather_full_tensor(param: Tensor, group: Group) -> Tensor:
    """The full (unsharded, unpadded) tensor of ``param`` on every rank of ``group``; a
    replicated parameter comes back as it is. Collective over ``group`` when sharded."""
    spec, t = shard_spec(param), param.detach()
    if spec is None:
        return t
    with torch.no_grad():
        shards = comm.gather_from_tp(t.unsqueeze(0).contiguous(), group, dim=0)  # [tp, *local]
    return unshard_tensor(list(shards.unbind(0)), spec)


def full_state_dict(model: Transformer, ctx: ParallelContext | None = None) -> dict[str, Tensor]:
    """Oases name -> full fp32 CPU tensor (a tied head appears once, as ``embed.weight``).
    Every rank must call it (it gathers each shard over the TP group of its region's degree)."""
    ctx = ctx if ctx is not None else model.parallel_ctx
    degrees = parameter_degrees(model)
    out = {}
    for name, p in model.named_parameters():
        group = None if ctx is None else ctx.groups_for(degrees.get(id(p), ctx.tp))[0]
        full = p.detach() if group is None else gather_full_tensor(p, group)
        out[name] = full.float().cpu()
    return out


def hf_state_dict(cfg: ModelConfig, full: dict[str, Tensor]) -> dict[str, Tensor]:
    """Split (and transpose) full Oases tensors into HF tensors with their canonical names."""
    out = {}
    for name, pieces in hf_pieces(cfg).items():
        if name not in full:
            raise ValueError(f"no parameter {name!r} to export")
        for pc, t in zip(pieces, full[name].split([pc.rows for pc in pieces], dim=0)):
            out[pc.name] = (t.t() if pc.transposed else t).contiguous().clone()
    return out


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_hf_dir(
    cfg: ModelConfig,
    full: dict[str, Tensor],
    out_dir: str | os.PathLike[str],
    doc_sep_id: int = 0,
    dtype: str = "fp32",
) -> Path:
    """Write ``config.json`` and ``model.safetensors`` for ``cfg`` into ``out_dir``, the
    weights cast to ``dtype`` (a key of ``HF_DTYPES``; ``doc_sep_id``: see ``config_to_hf``)."""
    if dtype not in HF_DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {', '.join(HF_DTYPES)}")
    save_file = safetensors_module("safetensors.torch").save_file
    hf_config = config_to_hf(cfg, doc_sep_id, dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch_dtype = getattr(torch, HF_DTYPES[dtype])
    tensors = {k: v.to(torch_dtype) for k, v in hf_state_dict(cfg, full).items()}
    tmp = out / (SINGLE_FILE + ".part")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, 0o666 & ~_umask())  # safetensors creates it 0600, as a private temp file
    os.replace(tmp, out / SINGLE_FILE)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n", encoding="utf-8")
    return out


def write_tokenizer_files(tok: Tokenizer, doc_sep_id: int, max_length: int, out_dir: Path) -> None:
    """``tokenizer.json`` and the ``tokenizer_config.json`` with which
    ``AutoTokenizer.from_pretrained(out_dir)`` loads it (the document separator as bos and
    eos token)."""
    sep = token_text(tok, doc_sep_id)
    (out_dir / TOKENIZER_FILE).write_text(tokenizer_json(tok), encoding="utf-8")
    conf = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": sep,
        "eos_token": sep,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(conf, indent=2) + "\n", encoding="utf-8"
    )


def save_hf(
    model: Transformer,
    out_dir: str | os.PathLike[str],
    ctx: ParallelContext | None = None,
    dtype: str = "fp32",
) -> Path:
    """Export ``model`` (single-device or parallelized at any tp) as a HF directory, its
    weights in ``dtype``.

    Under TP every rank must call it; global rank 0 writes and the others return at once
    (call ``comm.barrier`` before reading the files from another rank)."""
    ctx = ctx if ctx is not None else model.parallel_ctx
    full = full_state_dict(model, ctx)
    if ctx is None or ctx.rank == 0:
        write_hf_dir(model.cfg, full, out_dir, dtype=dtype)
    return Path(out_dir)


def _full_from_checkpoint(saved: dict[str, Tensor], name: str, shape: torch.Size) -> Tensor:
    """Rebuild a full parameter from a checkpoint's ``model.<name>`` or its ``/part<i>``s."""
    if f"model.{name}" in saved:
        return saved[f"model.{name}"]
    parts, i = [], 0
    while f"model.{name}/part{i}" in saved:
        parts.append(saved[f"model.{name}/part{i}"])
        i += 1
    if not parts:
        raise ValueError(f"checkpoint has no tensor for model.{name}")
    for dim in range(len(shape)):
        if (
            all(p.shape[:dim] + p.shape[dim + 1 :] == shape[:dim] + shape[dim + 1 :] for p in parts)
            and sum(p.shape[dim] for p in parts) == shape[dim]
        ):
            return torch.cat(parts, dim=dim)
    raise ValueError(f"checkpoint parts of model.{name} do not form its shape {list(shape)}")


MODEL_FILES = (SINGLE_FILE, "config.json", TOKENIZER_FILE)  # what an export writes over


def check_out_dir(out_dir: Path) -> None:
    """ValueError when ``out_dir`` already holds a model (one of ``MODEL_FILES``): an export
    never writes over another model unless asked (``overwrite``)."""
    held = [name for name in MODEL_FILES if (out_dir / name).exists()]
    if not held:
        return
    what = ""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        conf = json.loads((out_dir / "config.json").read_text(encoding="utf-8"))
        what = (
            f" ({conf.get('model_type', 'a model')}, {conf.get('num_hidden_layers', '?')} "
            f"layers, hidden size {conf.get('hidden_size', '?')})"
        )
    raise ValueError(
        f"{out_dir} already holds a model{what}: {', '.join(held)}; give "
        "--overwrite to replace it, or another --out"
    )


@user_input_errors
def export_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    dtype: str = "fp32",
    overwrite: bool = False,
) -> Path:
    """Write the HF directory of an Oases checkpoint (saved at any tp and precision), in this
    process alone (no process group), its weights in ``dtype`` ("fp32" | "bf16" | "fp16", cast
    from the checkpoint's master weights). ``checkpoint_dir`` is a checkpoint
    (``.../step_000123``), a folder of them or a run directory (the newest complete one:
    ``resume.find_checkpoint``). The run's tokenizer goes with it (``write_tokenizer_files``).
    A folder that already holds a model is refused (``check_out_dir``) unless ``overwrite``."""
    from oases.train.checkpoint import read_full_tensors, read_manifest
    from oases.train.resume import find_checkpoint

    path = find_checkpoint(Path(checkpoint_dir))
    manifest = read_manifest(path)
    if not overwrite:
        check_out_dir(Path(out_dir))
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    cfg = ModelConfig(**{k: v for k, v in manifest["config"]["model"].items() if k in known})
    tok = _checkpoint_tokenizer(path, manifest)
    info = manifest.get("extras", {}).get("tokenizer", {})
    doc_sep_id = int(info.get("doc_sep_id", tok.doc_sep_id))
    saved = read_full_tensors(path, "model.")
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in Transformer(cfg).named_parameters()}
    full = {n: _full_from_checkpoint(saved, n, s).float() for n, s in shapes.items()}
    out = write_hf_dir(cfg, full, out_dir, doc_sep_id, dtype)
    write_tokenizer_files(tok, doc_sep_id, cfg.seq_len, out)
    return out


def _checkpoint_tokenizer(path: Path, manifest: dict[str, Any]) -> Tokenizer:
    """The tokenizer a checkpoint was trained with: bytes, or its saved ``tokenizer.json``."""
    name = manifest["config"].get("data", {}).get("tokenizer", "byte")
    if name == "byte":
        return ByteTokenizer()
    if not (path / TOKENIZER_FILE).is_file():
        raise ValueError(
            f"checkpoint {path} was trained with data.tokenizer={name!r} but "
            f"holds no {TOKENIZER_FILE}"
        )
    if name.startswith(HF_PREFIX):
        return HFTokenizer.load(path / TOKENIZER_FILE)
    return BPETokenizer.load(path)
