"""What a run does is what it logs, saves and was planned for (issue 34), one test per item:

1. a plan's ZeRO stage and megatron-sp's sequence parallelism in the plan line, config.toml and
   the checkpoint's record;
2. plans record the precision they were priced in; a run in another one says so in one line;
3. settings that do nothing warn (or fail where surely a mistake); the planner names what a
   flag kept out of its search;
4. ``oases bench --memory`` says why a tiny model's peak is far from the simulator's, and names
   the source revision outside a checkout;
5. the console: the step's own loss, the mean named, the timeline step said and not timed, a
   done line that says what it counts;
6. parameter counts as people read them;
7. ``oases simulate``: aligned columns, a timeline per oases row, merak needs sub-batches, the
   dtypes ``oases plan`` prices;
8. the resume line names every change of layout, ZeRO and precision;
9. the README's key table is the config's field list; ``make setup`` is in the README;
10. one wording for the sequence split, a plan made for another world size, export refuses to
    overwrite another model.

Runs are one rank in this process (no process group), a tiny model on a small text file.
"""

import io
import json
from pathlib import Path

import pytest

from oases.cli import main
from oases.config import dump_toml, load_config
from oases.plan import ParallelPlan, RegionPlan, region_names
from oases.train.setup import check_config
from test_train_loop import TINY, tiny_cfg, write_text

REPO = Path(__file__).resolve().parent.parent


def _train(root: Path, name: str, *overrides: str) -> tuple[str, Path]:
    """A 2-step run of configs/tiny.toml on one rank: (everything rank 0 printed, run dir)."""
    from oases.train.loop import train

    if not (root / "text.txt").is_file():
        write_text(root / "text.txt")
    log = io.StringIO()
    train(
        tiny_cfg(
            root, name, "--parallel.tp=1", "--train.steps=2", "--train.sample_tokens=0", *overrides
        ),
        log=log,
    )
    return log.getvalue(), root / name


def _plan_file(path: Path, world: int, tp: int = 1, zero: int | None = None, **kw) -> Path:
    model = load_config(TINY).model
    ParallelPlan([RegionPlan(n, tp, world // tp, zero) for n in region_names(model)], **kw).save(
        path
    )
    return path


def _main(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


# ------------------------------------------------------------------ 1. what runs is what is said


def test_1_plan_zero_stage_in_the_plan_line_config_toml_and_checkpoint(tmp_path):
    plan = _plan_file(tmp_path / "plan.json", 1, zero=1, schedule="megatron", n_sub=1)
    log, run = _train(tmp_path, "a", f"--parallel.plan={plan}")
    line = next(ln for ln in log.splitlines() if ln.startswith("plan ("))
    assert line.startswith(f"plan ({plan}): megatron, n_sub=1, zero=1; every region tp=1")
    toml = (run / "config.toml").read_text()
    assert "\nzero = 1\n" in toml and load_config(run / "config.toml").parallel.zero == 1
    manifest = json.loads((run / "checkpoints" / "step_000002" / "oases.json").read_text())
    assert manifest["run"]["zero"] == 1 and manifest["config"]["parallel"]["zero"] == 1
    # on 2 ranks (checked without starting them): the stage the plan gives is the config's
    cfg = load_config(TINY, [f"--parallel.plan={_plan_file(tmp_path / 'p2.json', 2, zero=1)}"])
    check_config(cfg, 2)
    assert "\nzero = 1\n" in dump_toml(cfg)


def test_1_megatron_sp_turns_sequence_parallelism_on_in_the_saved_config():
    cfg = load_config(TINY, ["--schedule.name=megatron-sp", "--parallel.tp=2"])
    check_config(cfg, 2)
    assert "\nsequence_parallel = true\n" in dump_toml(cfg)
    assert cfg.parallel.sp() == "gathered"


# ------------------------------------------------------------------ 2. plans record precision


def test_2_a_plan_records_its_precision_and_a_run_in_another_says_so(capsys, tmp_path):
    plan = tmp_path / "plan.json"
    code, out, err = _main(
        capsys,
        "plan",
        str(TINY),
        "--parallel.tp=1",
        "--world-size",
        "1",
        "--hardware",
        "rtx3090-pcie",
        "--out",
        str(plan),
    )
    assert code == 0, err
    assert json.loads(plan.read_text())["precision"] == {
        "compute": "bf16",
        "grad_reduce": "fp32",
        "master": "fp32",
    }
    assert "priced   bf16 compute, fp32 grad reduce" in out
    log, run = _train(tmp_path, "a", f"--parallel.plan={plan}")
    warned = [ln for ln in log.splitlines() if "was priced in" in ln]
    assert warned == [
        f"warning: the plan ({plan}) was priced in bf16 compute, fp32 grad reduce,"
        " this run computes in fp32 with gradients reduced in fp32 "
        "(train.precision=auto): its predicted step time and memory are for the "
        "other dtypes; plan again with --train.precision=fp32, or train with "
        "--train.precision=bf16"
    ]
    assert "priced in bf16 compute, fp32 grad reduce" in next(
        ln for ln in log.splitlines() if ln.startswith("plan (")
    )
    # the same with a plan made at start-up from a GPU preset
    log, _ = _train(tmp_path, "b", "--parallel.plan=auto", "--parallel.profile=hw:rtx3090-pcie")
    assert sum("(auto) was priced in bf16 compute" in ln for ln in log.splitlines()) == 1
    # in the dtypes it was priced in: no warning
    log, _ = _train(tmp_path, "c", f"--parallel.plan={plan}", "--train.precision=bf16")
    assert "was priced in" not in log


# ------------------------------------------------------------------ 3. settings that do nothing


def test_3_settings_without_effect_warn_once_in_the_run_log(tmp_path):
    log, _ = _train(
        tmp_path,
        "a",
        "--parallel.zero=3",
        "--parallel.sp_recompute=shards",
        "--parallel.reshard_after_forward=false",
    )
    warnings = [ln for ln in log.splitlines() if ln.startswith("warning: ")]
    assert warnings == [
        "warning: ZeRO stage 3 has no effect: dp=1 (world size 1 / tp 1), no data-parallel "
        "group to shard over",
        "warning: parallel.sp_recompute='shards' has no effect without sequence parallelism "
        "(parallel.sequence_parallel=false)",
    ]
    log, _ = _train(tmp_path, "b", "--parallel.sequence_parallel=true")
    assert (
        "warning: sequence parallelism has no effect at tp=1: nothing to slice "
        "(parallel.sequence_parallel with a degree above 1 slices the sequence)"
    ) in log


def test_3_each_setting_without_effect_and_the_plans_replacements(tmp_path):
    from oases.train.setup import resolve_setup

    def warnings(*overrides: str, world: int = 2) -> list[str]:
        return resolve_setup(load_config(TINY, list(overrides)), world).warnings

    assert warnings() == []  # tiny.toml: tp=2 on 2 ranks, megatron
    assert warnings("--parallel.zero=1") == [
        "ZeRO stage 1 has no effect: dp=1 (world size 2 / tp 2), no data-parallel group to "
        "shard over"
    ]
    assert warnings("--parallel.zero=1", world=4) == []
    assert (
        "parallel.grad_reduce_dtype='bf16' has no effect: dp=1"
        in warnings("--parallel.grad_reduce_dtype=bf16")[0]
    )
    assert warnings("--parallel.sequence_parallel=true", "--parallel.sp_recompute=shards") == []
    assert warnings(
        "--parallel.sequence_parallel=true",
        "--parallel.sp_recompute=shards",
        "--schedule.name=megatron-recompute",
    ) == [
        "parallel.sp_recompute='shards' has no effect: megatron-recompute recomputes each "
        "block from its input's slice either way (it changes the schedules without recompute "
        "and the communication-free recompute)"
    ]
    assert warnings("--parallel.reshard_after_forward=false", "--parallel.zero=3", world=4) == []
    assert warnings("--schedule.n_sub=4")[0].startswith(
        "schedule.n_sub=4 has no effect: megatron runs each micro-batch whole"
    )
    assert warnings("--checkpoint.allow_data_change=true", "--checkpoint.resume=never") != []
    assert warnings("--parallel.pp_schedule=gpipe") == [
        "parallel.pp_schedule='gpipe' has no effect at parallel.pp=1: it orders the passes of "
        "pipeline stages"
    ]
    assert warnings("--parallel.pp_schedule=gpipe", "--parallel.pp=2", "--parallel.tp=1") == []
    # pipeline stages: dp counts the replicas inside one stage (pp=2 x tp=1 x dp=1 on 2 ranks)
    assert warnings("--parallel.zero=1", "--parallel.pp=2", "--parallel.tp=1")[0].startswith(
        "ZeRO stage 1 has no effect: dp=1"
    )
    plan = _plan_file(tmp_path / "plan.json", 2, tp=1, schedule="megatron", n_sub=1)
    # (tiny.toml's parallel.tp=2 is the unit the plan's batch counts in: used, not named)
    assert warnings(f"--parallel.plan={plan}", "--schedule.name=oases") == [
        f"the plan ({plan}) replaces schedule.name='oases' (runs 'megatron'): those settings "
        "have no effect with parallel.plan"
    ]
    # surely a mistake: the planner's budget where no planner runs
    with pytest.raises(
        ValueError,
        match=r"parallel.memory_gb=8.0 is used only with "
        r'parallel.plan = "auto"',
    ):
        load_config(TINY, ["--parallel.memory_gb=8"])


def test_3_the_planner_names_what_a_flag_kept_out(capsys, tmp_path):
    code, out, err = _main(
        capsys,
        "plan",
        str(TINY),
        "--world-size",
        "2",
        "--hardware",
        "rtx3090-pcie",
        "--zero",
        "2",
        "--sequence-parallel",
        "shards",
        "--max-tp",
        "2",
        "--out",
        str(tmp_path / "plan.json"),
    )
    assert code == 0, err
    kept_out = out.split("kept out of the search:\n")[1].split("\nwrote")[0].splitlines()
    assert kept_out == [
        "  --zero 2: tp=2 not searched (dp=1 at 2 ranks: no data-parallel group to shard "
        "over; --zero 0 plans it)",
        "  --sequence-parallel shards: megatron-recompute, overlap-recompute, merak searched "
        "without sequence parallelism (shards changes a schedule without recompute or with "
        "the communication-free one; block recompute is the same with gathered)",
    ]
    code, out, err = _main(
        capsys,
        "plan",
        str(TINY),
        "--parallel.tp=1",
        "--world-size",
        "1",
        "--hardware",
        "rtx3090-pcie",
        "--zero",
        "1",
        "--out",
        str(tmp_path / "p1.json"),
    )
    assert code == 2 and err.startswith("error: --zero 1: every candidate degree ([1]) leaves dp=1")


def test_3_a_bench_entrys_zero_stage_at_dp_1_warns():
    from oases.train.no_effect import bench_entry_warnings

    assert bench_entry_warnings([("oases@zero=1", 1), ("oases", 0)], dp=1) == [
        "bench entry 'oases@zero=1': ZeRO stage 1 has no effect at dp=1 (no data-parallel "
        "group to shard over)"
    ]
    assert bench_entry_warnings([("oases@zero=1", 1)], dp=2) == []


# ------------------------------------------------------------------ 4. bench --memory


def test_4_machine_line_names_the_source_revision_outside_a_checkout(tmp_path, monkeypatch):
    import subprocess

    from oases.bench import suite

    monkeypatch.chdir(tmp_path)  # not a git checkout
    assert suite.machine_info()["git"] not in ("", None)

    def no_git(*args, **kw):
        raise FileNotFoundError("git")

    monkeypatch.setattr(subprocess, "run", no_git)
    assert suite.source_revision() == "none (oases 0.1.0, not run from a git checkout)"


def test_4_memory_table_says_why_a_tiny_models_peak_is_far_from_the_simulators():
    from oases.bench.memory_suite import format_memory_table

    mib = 2**20
    rank = {
        "weights": 0.2 * mib,
        "gradients": 0.2 * mib,
        "optimizer": 0.4 * mib,
        "peak_over_base_mb": 15.9,
        "base_mb": 80.0,
        "code_pages_mb": 9.6,
    }
    result = {
        "tp": 1,
        "world_size": 2,
        "entries": {
            "oases": {
                "ranks": [rank],
                "predicted": {"model_state": {"weights": 0.2 * mib}, "peak": 0.5 * mib},
            }
        },
    }
    text = format_memory_table(result)
    row = next(ln for ln in text.splitlines() if ln.startswith("oases"))
    assert row.endswith("-97%*")
    note = text.split("\n* ")[1]
    assert "code of every kernel torch first runs in the entry" in note
    assert note.endswith(
        "  oases: 9.6 of its 15.9 MiB peak are code pages; without them 6.3 MiB, err -92%"
    )
    rank["code_pages_mb"] = 1.0  # a model whose tensors dominate: no note
    assert "*" not in format_memory_table(result)


# ------------------------------------------------------------------ 5. the console


def test_5_console_prints_the_steps_own_loss_and_names_the_mean():
    from oases.train.console import Console

    def lines(first: int) -> dict[int, str]:
        out = io.StringIO()
        console = Console(True, out)
        console.start(first, 9, 9, 4, tokens_per_step=100)
        for step in range(first + 1, 10):
            console.step(step, 5.0 - step / 10, 1e-3, 1.0, 0.01)
        return {int(ln.split()[1].split("/")[0]): ln for ln in out.getvalue().splitlines()}

    fresh, resumed = lines(0), lines(6)
    assert "loss 4.2000  mean 4.3500 over steps 5-8  lr" in fresh[8]
    assert "loss 4.2000  lr" in resumed[8]  # its window is one step after the restart
    for step in set(fresh) & set(resumed):  # the same loss at the same step, restart or not
        assert (
            fresh[step].split("lr")[0].split("mean")[0]
            == resumed[step].split("lr")[0].split("mean")[0]
        )


def test_5_the_timeline_step_is_said_and_not_timed_and_done_says_what_it_counts(tmp_path):
    from oases.train.supervise import finished_line

    log, run = _train(tmp_path, "a")
    assert any(
        ln.startswith("step     2/2  timeline of this step recorded: ")
        and "outside the step's time" in ln
        for ln in log.splitlines()
    )
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("timeline", False) for r in rows if "loss" in r] == [False, True]
    log, _ = _train(tmp_path, "a", "--checkpoint.resume=auto", "--train.steps=4")
    done = next(ln for ln in log.splitlines() if ln.startswith("done: "))
    assert (
        done.startswith("done: step 4/4; steps 3-4 in ")
        and "(resumed at step 2: steps 1-2 ran in an earlier launch)" in done
    )
    assert finished_line(1, 75.25) == (
        "finished after 1 restart: 75.2s since the launch, every "
        "attempt included (the done line above counts the last "
        "attempt's steps)"
    )


# ------------------------------------------------------------------ 6. parameter counts


def test_6_plan_prints_a_tiny_models_parameters_as_train_does(capsys, tmp_path):
    from oases.planner.models import describe_model

    text = describe_model(load_config(TINY).model)
    assert text.endswith(": 0.04 M parameters") and "0.00 B" not in text
    assert describe_model(load_config(REPO / "configs" / "default.toml").model).endswith(
        ": 0.88 M parameters"
    )
    code, out, _ = _main(
        capsys,
        "plan",
        str(TINY),
        "--world-size",
        "2",
        "--hardware",
        "rtx3090-pcie",
        "--out",
        str(tmp_path / "plan.json"),
    )
    assert code == 0 and "0.04 M parameters" in out.splitlines()[0]


# ------------------------------------------------------------------ 7. oases simulate


def test_7_simulate_columns_timelines_merak_and_dtypes(capsys, tmp_path):
    out_dir = tmp_path / "sim"
    code, out, err = _main(
        capsys,
        "simulate",
        "--model",
        str(TINY),
        "--cluster",
        "rtx3090-pcie",
        "--schedules",
        "megatron@tp=1,oases@tp=2,zero=1,sp=gathered,oases@tp=1",
        "--global-batch",
        "8",
        "--out",
        str(out_dir),
    )
    assert code == 0, err
    lines = out.splitlines()
    header = next(i for i, ln in enumerate(lines) if "micro x n" in ln)
    end = lines[header].index("micro x n") + len("micro x n")
    for row in lines[header + 1 : header + 4]:  # every row's micro-batch cell ends under it
        assert (
            row[:end].endswith(" x 1")
            or row[:end].endswith(" x 2")
            or row[:end].rstrip()[-1].isdigit()
        ), row
        assert row[end] == " " and row[end - 1].isdigit(), row
    pngs = sorted(p.name for p in out_dir.glob("timeline-*.png"))
    assert pngs == ["timeline-oases-tp1.png", "timeline-oases-tp2-zero1-spgathered.png"]
    data = json.loads((out_dir / "simulate.json").read_text())
    assert data["dtype"] == "bf16" and data["precision"]["grad_reduce"] == "fp32"
    assert f"(dtypes: {TINY}'s train.precision=auto as on GPUs)" in out
    code, _, err = _main(
        capsys,
        "simulate",
        "--model",
        str(TINY),
        "--cluster",
        "rtx3090-pcie",
        "--schedules",
        "merak@tp=2",
        "--n-sub",
        "1",
        "--global-batch",
        "8",
        "--out",
        str(out_dir),
    )
    assert code == 2 and "with one it is megatron-recompute's program" in err
    code, _, err = _main(
        capsys,
        "simulate",
        "--model",
        str(TINY),
        "--cluster",
        "rtx3090-pcie",
        "--schedules",
        "merak@auto",
        "--n-sub",
        "1",
        "--global-batch",
        "8",
        "--out",
        str(out_dir),
    )
    assert code == 0, err
    assert json.loads((out_dir / "simulate.json").read_text())["rows"][0]["plan"]["n_sub"] >= 2
    with pytest.raises(ValueError, match="with one it is megatron-recompute's program"):
        check_config(load_config(TINY, ["--schedule.name=merak", "--schedule.n_sub=1"]), 2)


# ------------------------------------------------------------------ 8. the resume line


def test_8_resume_line_names_zero_and_precision_changes(tmp_path):
    _train(tmp_path, "a")
    log, _ = _train(
        tmp_path,
        "a",
        "--checkpoint.resume=auto",
        "--train.steps=3",
        "--parallel.zero=1",
        "--train.precision=fp64",
    )
    line = next(ln for ln in log.splitlines() if ln.startswith("resumed from "))
    assert line.startswith(
        f"resumed from {tmp_path / 'a' / 'checkpoints' / 'step_000002'} at "
        "step 2 (saved at tp=1 on 1 rank); changed since: zero 0 -> 1, "
        "precision auto -> fp64, compute_dtype fp32 -> fp64, master_dtype "
        "fp32 -> fp64, grad_reduce_dtype fp32 -> fp64"
    ), line
    log, _ = _train(
        tmp_path,
        "a",
        "--checkpoint.resume=auto",
        "--train.steps=4",
        "--parallel.zero=1",
        "--train.precision=fp64",
    )
    line = next(ln for ln in log.splitlines() if ln.startswith("resumed from "))
    assert line.endswith("the same layout, schedule, ZeRO, precision and batch")


# ------------------------------------------------------------------ 9. README


def test_9_readme_lists_every_config_key_and_make_setup():
    from oases.config.keys import check_documented, key_table, readme_block

    check_documented()
    readme = (REPO / "README.md").read_text()
    assert readme_block(readme) == key_table(), (
        "README.md's key table is stale: run python -m oases.config.keys README.md"
    )
    for key in (
        "train.log_every",
        "train.eval_batches",
        "parallel.sequence_parallel",
        "parallel.sp_recompute",
    ):
        assert f"| `{key}` |" in readme
    assert "make setup" in readme.split("## Training")[0]


# ------------------------------------------------------------------ 10. wording


def test_10_one_wording_for_the_sequence_split_and_a_plans_world_size(tmp_path):
    cfg = load_config(TINY, ["--parallel.sequence_parallel=true", "--model.seq_len=33"])
    with pytest.raises(ValueError) as cli:
        check_config(cfg, 2)
    plan = _plan_file(
        tmp_path / "sp.json", 2, tp=2, schedule="megatron", n_sub=1, sequence_parallel="gathered"
    )
    cfg = load_config(TINY, ["--model.seq_len=33", f"--parallel.plan={plan}"])
    with pytest.raises(ValueError) as from_plan:
        check_config(cfg, 2)
    assert (
        str(cli.value)
        == str(from_plan.value)
        == ("sequence parallelism: model.seq_len=33 is not divisible by tp=2")
    )
    plan = _plan_file(tmp_path / "two.json", 2)
    with pytest.raises(ValueError) as info:
        check_config(load_config(TINY, [f"--parallel.plan={plan}"]), 4)
    assert str(info.value) == (
        "the plan was made for 2 ranks (embed: tp=1 x dp=2), this run "
        "has 4: run it on 2 ranks (--nproc-per-node 2), or plan again "
        "for 4"
    )


def test_10_export_refuses_a_folder_that_holds_another_model(capsys, tmp_path):
    pytest.importorskip("safetensors")
    _, run = _train(tmp_path, "a")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text(
        '{"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096}'
    )
    code, _, err = _main(capsys, "export", "--checkpoint", str(run), "--out", str(out))
    assert code == 2 and err.strip() == (
        f"error: {out} already holds a model (llama, 32 layers, hidden size 4096): "
        "config.json; give --overwrite to replace it, or another --out"
    )
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    code, _, err = _main(
        capsys, "export", "--checkpoint", str(run), "--out", str(out), "--overwrite"
    )
    assert code == 0, err
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt2"
