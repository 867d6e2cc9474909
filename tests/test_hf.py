"""Hugging Face import/export: tiny random transformers models, loaded at tp=1 and tp=2, sliced
reads at tp=2, export after training, clear errors, hf tokenizer.

Logits are compared in float64 (tests/exactness.py): ours at tp=2 or under a mixed plan equal
ours at tp=1 to 1e-10, and ours equal transformers' run with ``.double()`` to 1e-10 for GPT-2;
transformers' LLaMA computes its RMSNorm in float32 in every dtype, so there the bound is that of
its norms' fp32 rounding (``_hf64_tol``). The tp=1 loads are also compared in fp32, within the
bound derived from the model's reductions.

transformers is a test-only dependency: the module skips without it. The tp=2 rank functions
import only oases and safetensors; transformers runs in the parent.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from exactness import BITWISE, EXACT64, fp32_bound, fp32_tol, to64  # noqa: E402
from oases.hf import export_checkpoint, load_hf, save_hf  # noqa: E402
from oases.parallel.layers import shard_spec  # noqa: E402
from oases.train.tokenizer import HFTokenizer, build_tokenizer  # noqa: E402

V, S = 100, 32


def _tokens(vocab=V):
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))


def _hf64_tol(cfg, ref64: torch.Tensor) -> dict:
    """Ours against transformers, both in float64. GPT-2 runs in float64 throughout: EXACT64.
    transformers' LlamaRMSNorm computes ``hidden_states.to(torch.float32)`` in every dtype, so
    its float64 logits carry the fp32 rounding of 2L + 1 norms (a mean of H squares and a
    rsqrt each): the fp32 bound with depth 2 (2L + 1) and width H (exactness.py)."""
    if cfg.arch == "gpt2":
        return EXACT64
    return fp32_bound(ref64, 2 * (2 * cfg.n_layers + 1), cfg.dim)


def _ours64(model, tokens):
    """Our model's logits in float64 (the model is cast in place)."""
    with torch.no_grad():
        return to64(model).eval()(tokens)


def _gpt2(**kw):
    cfg = transformers.GPT2Config(
        n_embd=64,
        n_layer=2,
        n_head=4,
        vocab_size=V,
        n_positions=S,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        **kw,
    )
    return transformers.GPT2LMHeadModel(cfg)


def _llama(tied=False, cls="Llama", **kw):
    cfg = getattr(transformers, f"{cls}Config")(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=V,
        max_position_embeddings=S,
        tie_word_embeddings=tied,
        **kw,
    )
    return getattr(transformers, f"{cls}ForCausalLM")(cfg)


MODELS = {  # name -> (builder, save_pretrained kwargs)
    "gpt2": (_gpt2, {}),
    "llama": (_llama, {}),
    "llama-tied": (lambda: _llama(tied=True), {}),
    "llama-sharded": (_llama, {"max_shard_size": "40KB"}),
    "mistral": (lambda: _llama(cls="Mistral", sliding_window=None), {}),
}


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model.eval()(tokens).logits


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """name -> (directory, transformers' logits on _tokens() in fp32, the same in float64)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for i, (name, (build, save_kw)) in enumerate(MODELS.items()):
        torch.manual_seed(i)
        model = build()
        model.save_pretrained(root / name, **save_kw)
        ref32 = _hf_logits(model, _tokens())
        out[name] = (root / name, ref32, _hf_logits(model.double(), _tokens()))
    assert len(list((root / "llama-sharded").glob("model-*-of-*.safetensors"))) > 1
    return out


@pytest.mark.exact
@pytest.mark.parametrize("name", list(MODELS))
def test_load_tp1_matches_transformers(hf_dirs, name):
    path, ref, ref64 = hf_dirs[name]
    cfg, model = load_hf(path)
    assert cfg.arch == ("gpt2" if name == "gpt2" else "llama")
    assert cfg.tie_embeddings == (name in ("gpt2", "llama-tied"))
    assert (model.head.weight is model.embed.weight) == cfg.tie_embeddings
    assert ref.std() > 0.05  # random weights, not a degenerate model
    with torch.no_grad():  # fp32: the bound of the model's own reductions
        torch.testing.assert_close(
            model.eval()(_tokens()), ref, **fp32_tol(ref, cfg, _tokens().numel(), False)
        )
    torch.testing.assert_close(_ours64(model, _tokens()), ref64, **_hf64_tol(cfg, ref64))


def test_llama_qk_rows_are_rotate_half(hf_dirs):
    """HF LLaMA q/k rows are used as they are: permuting them to the interleaved (Meta) rotary
    layout breaks the match, so the equality above does test the rotary convention."""
    path, ref, _ = hf_dirs["llama"]
    cfg, model = load_hf(path)
    D = cfg.head_dim
    perm = torch.cat([torch.arange(0, D, 2), torch.arange(1, D, 2)])
    with torch.no_grad():
        w = model.blocks[0].attn.qkv.weight  # [(A + 2K) D, H]
        rows = (cfg.n_heads + cfg.n_kv_heads) * D  # the Q and K rows
        w[:rows] = w[:rows].view(-1, D, cfg.dim)[:, perm].reshape(rows, cfg.dim)
        assert (model.eval()(_tokens()) - ref).abs().max() > 1e-3


# ---------------------------------------------------------------- tp=2: sliced reads


REPLICATED = ("ln_", "norm", "wpe", "c_proj.bias")


def _recording_safe_open(real, log):
    """A ``safetensors.safe_open`` that logs (name, stored shape, read shape, how) per read."""

    class Slice:
        def __init__(self, name, inner):
            self.name, self.inner = name, inner

        def get_shape(self):
            return self.inner.get_shape()

        def __getitem__(self, index):
            t = self.inner[index]
            log.append((self.name, tuple(self.inner.get_shape()), tuple(t.shape), "slice"))
            return t

    class Handle:
        def __init__(self, filename, framework, device="cpu"):
            self.inner = real(filename, framework=framework, device=device)

        def __enter__(self):
            self.h = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.h.keys()

        def get_slice(self, name):
            return Slice(name, self.h.get_slice(name))

        def get_tensor(self, name):
            t = self.h.get_tensor(name)
            log.append((name, tuple(t.shape), tuple(t.shape), "get_tensor"))
            return t

    return Handle


def _load_tp2_rank(rank, world_size, dirs, tokens):
    import safetensors

    import oases

    ctx = oases.init_distributed(tp=world_size)
    out, real = {}, safetensors.safe_open
    for name, path in dirs.items():
        log = []
        safetensors.safe_open = _recording_safe_open(real, log)
        cfg, model = load_hf(path, ctx)
        logits = _ours64(model, tokens)
        # the same ShardSpecs (for checkpoints) as parallelizing a full model
        twin = oases.parallelize(oases.build_model(cfg), ctx)
        assert {n: shard_spec(p) for n, p in model.named_parameters()} == {
            n: shard_spec(p) for n, p in twin.named_parameters()
        }
        out[name] = (logits, log, {n: tuple(p.shape) for n, p in model.named_parameters()})
    # a mixed-degree plan (tp 2 and 1; the batch of 2 rows is sliced at tp=1): each region
    # reads its slices at its own degree, and save_hf gathers each over its own group
    from oases.plan import ParallelPlan, RegionPlan, region_names

    safetensors.safe_open = real
    for name, path in dirs.items():
        cfg = load_hf(path)[0]
        degrees = (2, 1, 2, 2, 1, 2)
        plan = ParallelPlan(
            [RegionPlan(n, t, world_size // t) for n, t in zip(region_names(cfg), degrees)]
        )
        mixed_ctx = oases.init_distributed(tp=2, degrees=plan.degrees())
        _, model = load_hf(path, mixed_ctx, plan)
        save_hf(model, f"{path}-mixed-export")  # the fp32 weights as loaded
        out[name, "mixed"] = _ours64(model, tokens)
    return out


@pytest.mark.exact
def test_load_tp2_matches_and_reads_only_slices(hf_dirs, spawn_ranks):
    dirs = {name: str(path) for name, (path, _, _) in hf_dirs.items()}
    results = spawn_ranks(_load_tp2_rank, 2, dirs, _tokens())
    tp1 = {name: _ours64(load_hf(path)[1], _tokens()) for name, path in dirs.items()}
    for rank, res in enumerate(results):
        for name in dirs:
            mixed = res.pop((name, "mixed"))
            torch.testing.assert_close(mixed, tp1[name], **EXACT64, msg=f"{name} mixed")
            _, again = load_hf(f"{dirs[name]}-mixed-export")  # the export is the same model
            torch.testing.assert_close(_ours64(again, _tokens()), tp1[name], **BITWISE)
        for name, (logits, log, shapes) in res.items():
            torch.testing.assert_close(logits, tp1[name], **EXACT64, msg=f"{name} r{rank}")
            heads = 4 + 2 * (4 if name == "gpt2" else 2)  # A + 2K (GQA for llama)
            assert shapes["blocks.0.attn.qkv.weight"] == (heads * 16 // 2, 64)  # [(A+2K)D/2, H]
            assert not [r for r in log if r[3] == "get_tensor"], "a whole tensor was read"
            read: dict[str, int] = {}
            for tensor, stored, got, _ in log:
                n_stored, n_got = torch.Size(stored).numel(), torch.Size(got).numel()
                if not any(key in tensor for key in REPLICATED):
                    # every read of a sharded weight is a slice of at most 1/tp of it
                    assert n_got * 2 <= n_stored, (name, tensor, stored, got)
                read[tensor] = read.get(tensor, 0) + n_got
            for tensor, n in read.items():  # and the slices add up to exactly 1/tp
                stored = next(r[1] for r in log if r[0] == tensor)
                if not any(key in tensor for key in REPLICATED):
                    assert n * 2 == torch.Size(stored).numel(), (name, tensor)


# ---------------------------------------------------------------- export after training


def _train_export_rank(rank, world_size, llama_dir, out_root, tokens):
    import oases
    from oases.parallel import comm
    from oases.parallel.context import build_tp_mesh
    from oases.train import checkpoint as ckpt

    ctx = oases.init_distributed(tp=world_size)
    torch.manual_seed(0)
    gpt2_cfg = oases.ModelConfig(
        arch="gpt2", n_layers=2, dim=64, n_heads=4, vocab_size=101, seq_len=S, tie_embeddings=False
    )  # V padded to 102 at tp=2
    models = {
        "llama": load_hf(llama_dir, ctx)[1],
        "gpt2": oases.parallelize(oases.build_model(gpt2_cfg), ctx),
    }
    out = {}
    for name, model in models.items():
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        schedule = oases.build_schedule("megatron")
        x = torch.randint(
            0, model.cfg.vocab_size, (4, S + 1), generator=torch.Generator().manual_seed(7)
        )
        for _ in range(3):
            opt.zero_grad()
            schedule.step(model, x[:, :-1], x[:, 1:])
            opt.step()
        with torch.no_grad():
            logits = model.eval()(tokens)  # fp32
        save_hf(model, f"{out_root}/{name}")
        if name == "llama":  # a tp=2 checkpoint, exported later by export_checkpoint
            cfg = oases.Config(model=model.cfg)
            ckpt.save_checkpoint(
                Path(out_root) / "ckpt",
                3,
                model,
                opt,
                {},
                cfg,
                ctx,
                {ctx.tp: build_tp_mesh(ctx)},
                keep=1,
            )
        comm.barrier(ctx.world_group)
        # the exported directory reloads at tp=2 (for gpt2: vocabulary padding on read)
        _, again = load_hf(f"{out_root}/{name}", ctx)
        with torch.no_grad():
            torch.testing.assert_close(again.eval()(tokens), logits, **BITWISE)
        out[name] = _ours64(model, tokens)  # the trained weights, in float64
    return out


@pytest.mark.exact
def test_export_after_training_tp2(hf_dirs, spawn_ranks, tmp_path):
    llama_dir, before, _ = hf_dirs["llama"]
    tokens = _tokens()
    results = spawn_ranks(_train_export_rank, 2, str(llama_dir), str(tmp_path), tokens)
    torch.testing.assert_close(results[0], results[1], **BITWISE)
    assert (results[0]["llama"] - before).abs().max() > 1e-2  # training changed the weights
    for name, cls in (
        ("llama", transformers.LlamaForCausalLM),
        ("gpt2", transformers.GPT2LMHeadModel),
    ):
        cfg = load_hf(tmp_path / name)[0]
        ref = _hf_logits(cls.from_pretrained(tmp_path / name).double(), tokens)
        torch.testing.assert_close(ref, results[0][name], **_hf64_tol(cfg, ref), msg=name)
    # the tp=2 checkpoint exports in one process, to the same model
    # (a folder of checkpoints stands for its newest one)
    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "from-ckpt")
    ref = _hf_logits(transformers.LlamaForCausalLM.from_pretrained(out).double(), tokens)
    torch.testing.assert_close(ref, results[0]["llama"], **_hf64_tol(load_hf(out)[0], ref))


def test_save_tp1_round_trip(hf_dirs, tmp_path):
    path, ref, _ = hf_dirs["llama-tied"]
    _, model = load_hf(path)
    save_hf(model, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out")
    # the same weights, bit for bit, in the same transformers model: the same logits
    torch.testing.assert_close(_hf_logits(again, _tokens()), ref, **BITWISE)


@pytest.mark.exact
def test_bf16_weights_load_as_fp32(tmp_path):
    torch.manual_seed(5)
    model = _llama().to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    cfg, ours = load_hf(tmp_path, dropout=0.1)
    assert cfg.dropout == 0.1 and ours.embed.weight.dtype == torch.float32
    # transformers' reference reloaded from the files: ``model`` itself was cast to bf16 in
    # memory, which rounds its rotary frequencies too (a buffer), unlike a model loaded from
    # bf16 files; bf16 weights are exact in float64
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    ref = _hf_logits(hf.double(), _tokens())
    torch.testing.assert_close(_ours64(ours, _tokens()), ref, **_hf64_tol(cfg, ref))


# ---------------------------------------------------------------- errors


def _copy(hf_dirs, name, tmp_path):
    return shutil.copytree(hf_dirs[name][0], tmp_path / name)


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"model_type": "bert"}, "model_type='bert'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type='yarn'"),
        ({"sliding_window": 8}, "sliding_window=8"),
    ],
)
def test_unsupported_architectures(hf_dirs, tmp_path, changes, match):
    path = _copy(hf_dirs, "llama", tmp_path)
    _edit_config(path, **changes)
    with pytest.raises(ValueError, match=match) as info:
        load_hf(path)
    assert "\n" not in str(info.value) and "unsupported" in str(info.value)


def test_missing_files(hf_dirs, tmp_path):
    path = _copy(hf_dirs, "gpt2", tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="missing model.safetensors"):
        load_hf(path)
    (path / "config.json").unlink()
    with pytest.raises(ValueError, match="missing config.json"):
        load_hf(path)
    sharded = _copy(hf_dirs, "llama-sharded", tmp_path)
    shard = sorted(sharded.glob("model-*-of-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ValueError, match=f"missing {shard.name} \\(listed in"):
        load_hf(sharded)
    untied = _copy(hf_dirs, "llama-tied", tmp_path)
    _edit_config(untied, tie_word_embeddings=False)  # now lm_head.weight is missing
    with pytest.raises(ValueError, match="missing tensor 'lm_head.weight'"):
        load_hf(untied)


@pytest.mark.exact
def test_max_seq_len_caps_positions(hf_dirs):
    path, _, ref64 = hf_dirs["gpt2"]
    cfg, model = load_hf(path, max_seq_len=16)
    assert cfg.seq_len == 16 and model.pos_embed.weight.shape[0] == 16
    torch.testing.assert_close(_ours64(model, _tokens()), ref64, **EXACT64)


# ---------------------------------------------------------------- tokenizer


def test_hf_tokenizer(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["hello world, hello oases"] * 20, trainer=trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = build_tokenizer(f"hf:{tmp_path}")
    assert isinstance(hf, HFTokenizer) and hf.name == "hf"
    assert hf.doc_sep_id == tok.token_to_id("</s>") == 1  # a usual end-of-text name
    assert hf.decode(hf.encode("hello oases")) == "hello oases"
    assert hf.vocab_size == tok.get_vocab_size()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<pad>"}))
    assert build_tokenizer(f"hf:{tmp_path}").doc_sep_id == 0
    with pytest.raises(ValueError, match="more than the model's vocab_size=10"):
        build_tokenizer(f"hf:{tmp_path}", vocab_size=10)
    with pytest.raises(ValueError, match="missing .*tokenizer.json"):
        build_tokenizer(f"hf:{tmp_path / 'nope'}")


@pytest.mark.slow
@pytest.mark.exact
def test_cli_train_from_hf_then_export(tmp_path):
    """`oases train --model.init_from=hf:DIR` at tp=2, then `oases export`: transformers loads
    the export, and its logits equal the trained Oases model's (read back from the checkpoint)."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    torch.manual_seed(7)
    src = tmp_path / "src"
    transformers.LlamaForCausalLM(
        transformers.LlamaConfig(  # the byte tokenizer needs 256 ids
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=96,
            vocab_size=256,
            max_position_embeddings=S,
            tie_word_embeddings=False,
        )
    ).save_pretrained(src)
    run, out = tmp_path / "run", tmp_path / "exported"
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    env["PYTHONPATH"] = os.pathsep.join([str(repo / "src"), env.get("PYTHONPATH", "")])

    def cli(*args):
        proc = subprocess.run(
            [sys.executable, "-m", "oases", *args],
            cwd=repo,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    cli(
        "train",
        "configs/tiny.toml",
        "--nproc-per-node",
        "2",
        f"--model.init_from=hf:{src}",
        "--model.seq_len=32",
        f"--train.run_dir={run}",
        "--train.steps=3",
        "--train.sample_tokens=0",
        "--checkpoint.every=0",
    )
    assert "wrote" in cli("export", "--checkpoint", str(run / "checkpoints"), "--out", str(out))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    cfg, model = load_hf(out)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    ref = _hf_logits(hf.double(), tokens)
    torch.testing.assert_close(_ours64(model, tokens), ref, **_hf64_tol(cfg, ref))
    hf.float()
    start = transformers.AutoModelForCausalLM.from_pretrained(src)
    assert not torch.allclose(_hf_logits(start, tokens), _hf_logits(hf, tokens))  # it trained


def test_damaged_files_give_one_line_errors(hf_dirs, tmp_path):
    d = _copy(hf_dirs, "gpt2", tmp_path)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "n_embd"}))
    with pytest.raises(ValueError, match="missing.*n_embd"):
        load_hf(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="invalid JSON"):
        load_hf(d)
    (d / "config.json").write_text(json.dumps(config))
    (d / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="Safetensor"):
        load_hf(d)


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_export_a_run_directory_with_its_tokenizer(tmp_path, tokenizer):
    """`export` of a run directory takes its newest checkpoint; config.json's bos/eos are the
    run's document separator, inside the vocabulary; AutoTokenizer loads the run's tokenizer and
    encodes like it; the weights file has the usual permissions."""
    import os
    import stat

    from oases.train.tokenizer import build_tokenizer, load_tokenizer
    from test_train_loop import run, tiny_cfg, write_text

    write_text(tmp_path / "text.txt")
    bpe = ["--data.tokenizer=bpe", "--data.vocab_size=300", "--model.vocab_size=300"]
    extra = bpe if tokenizer == "bpe" else ["--model.vocab_size=256"]
    run(tiny_cfg(tmp_path, "run", "--parallel.tp=1", "--train.sample_tokens=0", *extra))
    old_umask = os.umask(0o022)
    try:
        out = export_checkpoint(tmp_path / "run", tmp_path / "hf")
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o644
    ours = load_tokenizer(tmp_path / "run") if tokenizer == "bpe" else build_tokenizer("byte")
    config = json.loads((out / "config.json").read_text())
    assert config["bos_token_id"] == config["eos_token_id"] == ours.doc_sep_id
    assert 0 <= ours.doc_sep_id < config["vocab_size"]
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "def f(x):\n    return 'héllo' + x  # ünïcode ✓\n"
    assert hf_tok.encode(text) == ours.encode(text)
    assert hf_tok.decode(ours.encode(text)) == text
    assert hf_tok.eos_token_id == hf_tok.bos_token_id == ours.doc_sep_id
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.config.bos_token_id == ours.doc_sep_id
    # the run's own checkpoint folder and a step folder name the same checkpoint
    step = tmp_path / "run" / "checkpoints" / "step_000006"
    for path in (tmp_path / "run" / "checkpoints", step):  # the second over the first
        again = export_checkpoint(path, tmp_path / "again", overwrite=path == step)
        assert (again / "model.safetensors").read_bytes() == (
            out / "model.safetensors"
        ).read_bytes()
    with pytest.raises(ValueError, match=r"no complete checkpoint \(looked in "):
        export_checkpoint(tmp_path, tmp_path / "nothing")
    # --dtype bf16: the fp32 export's weights rounded to bf16, named so in config.json
    half = export_checkpoint(tmp_path / "run", tmp_path / "bf16", "bf16")
    assert json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"
    st = pytest.importorskip("safetensors.torch")
    full, low = st.load_file(out / "model.safetensors"), st.load_file(half / "model.safetensors")
    assert set(full) == set(low)
    for k, v in full.items():
        assert low[k].dtype == torch.bfloat16 and torch.equal(low[k], v.to(torch.bfloat16))
    assert transformers.AutoModelForCausalLM.from_pretrained(half).dtype == torch.bfloat16
