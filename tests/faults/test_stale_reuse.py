"""Stale reuse: whatever a stage's output depends on changed, the stage re-runs or refuses, never reports done.

Prepare: the template's text (edited in place), an input file (size or mtime), data.output, the raypipe version;
in a job's copy of its working dir, an input's content, not its folder or mtime (both new in each copy).
Train: its settings (a resume under others is refused by the run's own checkpoint, through real Ray Train), the
prepared data (the manifest's digest). A prepared shard changed after the data stage is refused when read.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

import raypipe
from raypipe.assets.templates import load_template
from raypipe.config import RaypipeConfig, load_config, redact
from raypipe.data.output import PreparedOutput, dependencies
from raypipe.data.sources import plan_chunks
from raypipe.layout import RunFolders, eval_output
from raypipe.pipeline import StageLog, eval_fingerprint, prepare_fingerprint, train_fingerprint
from raypipe.storage import Storage, filesystem
from raypipe.target import target_digest
from raypipe.train.rows import PreparedRows
from tests.helpers import local_target, prepare_records, qwen_spec

ROWS = [
    {
        "id": f"r{i}",
        "messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}],
    }
    for i in range(40)
]


def inputs(root: Path) -> Path:
    """Two small JSONL files and a copy of the qwen_strict template, to be edited in place."""
    (root / "in").mkdir(parents=True)
    for name, rows in (("a", ROWS[:25]), ("b", ROWS[25:])):
        (root / "in" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "template.jinja").write_text(load_template("qwen_strict"))
    return root


def config(root: Path, *overrides: str) -> RaypipeConfig:
    return load_config(
        "debug_cpu",
        [
            f"data.sources=[{{path: '{root}/in/*.jsonl', name: mixed}}]",
            f"data.output={root}/prepared",
            f"data.chat_template={root}/template.jinja",
            "data.max_length=64",
            "data.chunk_bytes=1024",
            "data.num_actors=1",
            "data.cpus_per_actor=0.5",
            f"train.output={root}/train",
            *overrides,
        ],
    )


def plan_doc(cfg: RaypipeConfig) -> tuple[dict[str, Any], Any]:
    """plan.json as run_prepare writes it, and the tokenizer start() saves beside it."""
    from raypipe.data.tokenizer import resolve_tokenizer

    tok, spec = resolve_tokenizer(cfg.data)
    deps = dependencies(cfg.data, spec)
    return {**deps, "chunks": [c.to_dict() for c in plan_chunks(cfg.data.sources, {}, cfg.data.chunk_bytes)]}, tok


def start(cfg: RaypipeConfig) -> None:
    doc, tok = plan_doc(cfg)
    PreparedOutput(cfg.data.output, {}).start(doc, tok)


def edit_template(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same name, same rendering (a Jinja comment), other text."""
    path = root / "template.jinja"
    path.write_text(path.read_text() + "{#- edited in place -#}")


def touch(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = root / "in" / "a.jsonl"
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5_000_000_000))


def grow(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with open(root / "in" / "b.jsonl", "a") as f:
        f.write(json.dumps(ROWS[0]) + "\n")


def bump_version(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(raypipe, "__version__", raypipe.__version__ + ".post1")


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        (edit_template, "tokenizer or chat template"),
        (touch, "input files"),
        (grow, "input files"),
        (bump_version, "raypipe version"),
    ],
    ids=["template_edited_in_place", "input_mtime", "input_size", "raypipe_version"],
)
def test_a_changed_dependency_reruns_prepare_and_the_old_output_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change, refusal
) -> None:
    root = inputs(tmp_path)
    cfg = config(root)
    start(cfg)
    StageLog(cfg).mark("prepare", 1.0, {})
    assert StageLog(cfg).done("prepare") is not None
    start(cfg)  # the same plan: a resume

    change(root, monkeypatch)
    assert StageLog(cfg).done("prepare") is None, "the stage log would skip prepare"
    with pytest.raises(
        ValueError, match=rf"holds a run made with a different {refusal} .*set a new data.output, or delete .*prepared"
    ):
        start(cfg)


def test_a_new_data_output_reruns_prepare(tmp_path: Path) -> None:
    root = inputs(tmp_path)
    cfg = config(root)
    StageLog(cfg).mark("prepare", 1.0, {})
    assert StageLog(config(root, "data.num_actors=2")).done("prepare") is None  # parallelism too: cheap to resume
    assert StageLog(config(root, f"data.output={root}/elsewhere")).done("prepare") is None
    assert StageLog(config(root)).done("prepare") is not None


def test_train_export_and_eval_chain_on_the_prepared_data_and_train_settings(tmp_path: Path) -> None:
    root = inputs(tmp_path)
    (root / "prepared").mkdir()
    manifest = root / "prepared" / "manifest.json"
    manifest.write_text('{"shards": []}\n')
    cfg = config(root)
    log = StageLog(cfg)
    for stage in ("train", "export", "eval"):
        log.mark(stage, 1.0, {})
    assert all(StageLog(cfg).done(s) is not None for s in ("train", "export", "eval"))
    assert log.fingerprint("export") == log.fingerprint("train")

    manifest.write_text('{"shards": [], "rewritten": true}\n')  # the data stage ran again with other results
    fresh = StageLog(cfg)
    assert [fresh.done(s) for s in ("train", "export", "eval")] == [None, None, None]

    manifest.write_text('{"shards": []}\n')
    changed = StageLog(config(root, "train.optim.lr=0.01"))
    assert [changed.done(s) for s in ("train", "export", "eval")] == [None, None, None]
    assert StageLog(config(root, "eval.num_prompts=3")).done("train") is not None
    # How the run executes re-runs nothing; what the drafter trains on (the served states' dtype) does.
    assert StageLog(config(root, "train.run.num_workers=1", "train.run.log_every=3")).done("train") is not None
    assert StageLog(config(root, "serve.dtype=float32")).done("train") is None
    assert StageLog(config(root, "eval.num_prompts=3")).done("eval") is None
    sha = hashlib.sha256(b"x").hexdigest()
    assert train_fingerprint(cfg, sha, "t") != train_fingerprint(cfg, hashlib.sha256(b"y").hexdigest(), "t")
    assert eval_fingerprint(cfg, "a") != eval_fingerprint(cfg, "b")


def fake_manifest(root: Path) -> Path:
    """A prepared output's manifest, all that replies', train's and eval's fingerprints read of it."""
    (root / "prepared").mkdir(exist_ok=True)
    manifest = root / "prepared" / "manifest.json"
    manifest.write_text('{"shards": []}\n')
    return manifest


def retrain_target(target: Path) -> None:
    local_target(target, scale=2.0)  # an upstream update: the same names and shapes, other weights


def edit_target_config(target: Path) -> None:
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "rope_theta": 5e6}))


@pytest.mark.parametrize("change", [retrain_target, edit_target_config], ids=["weights", "config_json"])
def test_replies_train_export_and_eval_rerun_after_the_targets_update_in_place(tmp_path: Path, change) -> None:
    root = inputs(tmp_path)
    fake_manifest(root)
    target = local_target(root / "target")
    cfg = config(root, f"serve.model={target}")
    stages = ("replies", "train", "export", "eval")
    log = StageLog(cfg)
    for stage in stages:
        log.mark(stage, 1.0, {})
    assert all(StageLog(cfg).done(s) is not None for s in stages)

    change(target)  # the same serve.model
    assert [StageLog(cfg).done(s) for s in stages] == [None] * 4, "a resubmitted pipeline would skip them"


def test_train_export_and_eval_rerun_under_another_raypipe_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = inputs(tmp_path)
    fake_manifest(root)
    cfg = config(root)
    log = StageLog(cfg)
    for stage in ("replies", "train", "export", "eval"):
        log.mark(stage, 1.0, {})
    bump_version(root, monkeypatch)
    assert [StageLog(cfg).done(s) for s in ("train", "export", "eval")] == [None] * 3
    assert StageLog(cfg).done("replies") is not None  # the target's replies: vLLM's, not raypipe's


def test_eval_reruns_when_the_content_of_eval_prompts_changes(tmp_path: Path) -> None:
    root = inputs(tmp_path)
    fake_manifest(root)
    prompts = root / "heldout.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:4]))
    cfg = config(root, f"eval.prompts={prompts}", "eval.num_prompts=3")
    log = StageLog(cfg)
    for stage in ("train", "export", "eval"):
        log.mark(stage, 1.0, {})

    prompts.write_text("".join(json.dumps(r) + "\n" for r in [*ROWS[:3], ROWS[20]]))  # past num_prompts: unread
    assert StageLog(cfg).done("eval") is not None
    prompts.write_text("".join(json.dumps(r) + "\n" for r in [ROWS[10], *ROWS[1:4]]))  # the same path, other prompts
    assert StageLog(cfg).done("eval") is None and StageLog(cfg).done("train") is not None


def test_runs_of_two_names_under_one_train_output_keep_their_own_records_drafter_and_eval(tmp_path: Path) -> None:
    root = inputs(tmp_path)
    fake_manifest(root)
    first, second = config(root, "name=first"), config(root, "name=second")
    log = StageLog(first)
    for stage in ("train", "export", "eval"):
        log.mark(stage, 1.0, {})
    # The same settings under another name: its own training run (ray_train/second), not first's records.
    assert [StageLog(second).done(s) for s in ("train", "export", "eval")] == [None] * 3
    one, two = RunFolders.of(first), RunFolders.of(second)
    for folder in ("stages", "export", "eval", "ledger", "tensorboard"):
        assert getattr(one, folder).url != getattr(two, folder).url, folder
    assert eval_output(first).url != eval_output(second).url


def test_a_resume_after_the_targets_update_in_place_is_refused(tmp_path: Path) -> None:
    """The launcher's resume check on a checkpoint as the loop writes it: Ray Train would restore the run (a finished
    one included) and pass the old target's drafter off as the new one's."""
    from types import SimpleNamespace

    from raypipe.train.launcher import _refuse_other_settings

    root = inputs(tmp_path)
    manifest = fake_manifest(root)
    target = local_target(root / "target")
    cfg = config(root, f"serve.model={target}")
    runs = Storage(str(root / "train" / "ray_train"), {})
    runs.write_json("run/checkpoint_0/config.json", redact(cfg.model_dump()))
    runs.write_json(
        "run/checkpoint_0/provenance.json",
        {
            "data_manifest_sha256": hashlib.sha256(manifest.read_bytes()).hexdigest(),
            "target_digest": target_digest(cfg.serve),
        },
    )
    result = SimpleNamespace(checkpoint=SimpleNamespace(path=runs.path("run/checkpoint_0")))
    _refuse_other_settings(cfg, runs, result)  # the same target: resumed

    retrain_target(target)
    with pytest.raises(ValueError, match=r"trained with other settings or data \(target digest: '[0-9a-f]{16}' there"):
        _refuse_other_settings(cfg, runs, result)


def test_prepare_fingerprint_covers_template_text_inputs_output_and_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = inputs(tmp_path)
    seen = {prepare_fingerprint(config(root).data)}
    for change in (edit_template, touch, grow, bump_version):
        change(root, monkeypatch)
        seen.add(prepare_fingerprint(config(root).data))
    seen.add(prepare_fingerprint(config(root, f"data.output={root}/elsewhere").data))
    assert len(seen) == 6
    assert prepare_fingerprint(config(root).data) == prepare_fingerprint(config(root).data)


def prepare_here(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """run_prepare with its actors' work done in this process (the same ShardPreparer and write_shard, no Ray); the
    indices of the chunks prepared, in order."""
    from raypipe.data import pipeline
    from raypipe.data.prepare import ShardPreparer

    prepared: list[int] = []

    def run_actors(cfg: Any, spec: Any, todo: list[Any]) -> dict[str, float]:
        output, preparer = PreparedOutput.of(cfg), ShardPreparer(cfg, spec)
        for chunk in todo:
            output.write_shard(preparer.prepare(chunk))
            prepared.append(chunk.index)
        return {}

    monkeypatch.setattr(pipeline, "_run_actors", run_actors)
    return prepared


def test_a_resubmitted_job_resumes_its_prepared_output_from_a_new_copy_of_the_working_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job's inputs inside its --working-dir come from Ray's copy of that folder, unpacked without the files' times
    under a folder named by the content's hash: a resubmission after an edit of the checkout, or in a new Ray session,
    reads the same data from a new folder with new mtimes (issue 40, item 9). Its absolute data.output resumes: the
    stage log skips prepare, and a missing shard is the only one redone. A changed input is still refused, even one
    of the same size and mtime."""
    from raypipe.data.pipeline import run_prepare

    prepared = prepare_here(monkeypatch)
    packages = tmp_path / "session_1" / "runtime_resources" / "working_dir_files"
    first = inputs(packages / "_ray_pkg_aaa")
    out = tmp_path / "runs" / "prepared"
    overrides = [
        "data.sources=[{path: in/*.jsonl, name: mixed}]",  # relative, as the demo recipe's: inside the package
        "data.chat_template=template.jinja",
        f"data.output={out}",
        f"train.output={tmp_path}/runs/train",
    ]
    monkeypatch.chdir(first)  # the job's driver runs in the package
    cfg = config(first, *overrides)
    manifest = run_prepare(cfg.data)
    StageLog(cfg).mark("prepare", 1.0, manifest["counts"])
    assert len(prepared) > 2 and manifest["counts"]["rows_kept"] == len(ROWS)
    plan = (out / "plan.json").read_text()
    assert '"working_dir:in/a.jsonl"' in plan and "_ray_pkg_" not in plan, plan

    second = tmp_path / "session_2" / "runtime_resources" / "working_dir_files" / "_ray_pkg_bbb"
    shutil.copytree(first, second, copy_function=shutil.copy)  # Ray keeps no file times
    for path in (second / "in").iterdir():
        os.utime(path, (path.stat().st_atime + 60, path.stat().st_mtime + 60))
    shutil.rmtree(packages.parent.parent)  # the old session is gone
    monkeypatch.chdir(second)
    cfg = config(second, *overrides)
    assert StageLog(cfg).done("prepare") is not None, "a resubmitted pipeline would prepare again"
    (out / "stats" / "part-000001.json").unlink()  # as if the first job had been killed before that shard
    prepared.clear()
    assert run_prepare(cfg.data) == manifest and prepared == [1]

    a = second / "in" / "a.jsonl"  # one character edited: same size, same mtime
    stat = a.stat()
    a.write_text(a.read_text().replace("question 1", "question 7", 1))
    os.utime(a, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert StageLog(cfg).done("prepare") is None
    with pytest.raises(ValueError, match=r"holds a run made with a different input files"):
        run_prepare(cfg.data)

    monkeypatch.chdir(tmp_path)  # a package's name read where no package is: a clear error, not another file
    with pytest.raises(ValueError, match=r"working_dir:in/a\.jsonl names a file of .* but this process runs in none"):
        filesystem("working_dir:in/a.jsonl", {})


def _corrupt_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 8):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-20])


@pytest.mark.parametrize("damage", [_corrupt_middle, _truncate], ids=["bytes_flipped", "truncated"])
def test_a_changed_prepared_shard_is_refused_when_training_reads_it(tmp_path: Path, damage) -> None:
    out = PreparedOutput(str(tmp_path / "prepared"), {})
    result = prepare_records(tmp_path, ROWS)
    stats = out.write_shard(result)
    _, spec = qwen_spec()
    out.write_json(
        "manifest.json",
        {
            "shards": [{"file": stats["file"], "rows": stats["rows_kept"], "sha256": stats["sha256"]}],
            "end_of_turn": {"token": spec.end_of_turn, "id": spec.end_of_turn_id},
        },
    )
    rows = PreparedRows(out, Storage(str(tmp_path / "replies"), {}), max_length=64)
    assert [rows.row(i).sample_id for i in range(len(rows))] == [r["id"] for r in ROWS]  # intact: read as is

    damage(tmp_path / "prepared" / stats["file"])
    with pytest.raises(
        ValueError,
        match=r"prepared shard .*/data/part-000000\.parquet does not match manifest\.json .*stats/part-000000\.json",
    ):
        rows = PreparedRows(out, Storage(str(tmp_path / "replies"), {}), max_length=64)
        for i in range(len(rows)):
            rows.row(i)


@pytest.mark.integration
def test_prepare_reruns_through_the_real_data_stage_after_a_template_edit_in_place(
    ray_cluster: str, tmp_path: Path
) -> None:
    from raypipe.data.pipeline import run_prepare

    def pipeline_prepare(cfg: RaypipeConfig) -> dict[str, Any] | None:
        """What run_pipeline does for its first stage: skip when done, else run and mark."""
        log = StageLog(cfg)
        if log.done("prepare") is not None:
            return None
        manifest = run_prepare(cfg.data)
        log.mark("prepare", 1.0, manifest["counts"])
        return manifest

    root = inputs(tmp_path)
    first = pipeline_prepare(config(root))
    assert first is not None and first["counts"]["rows_kept"] == len(ROWS)
    assert pipeline_prepare(config(root)) is None  # nothing changed: skipped

    edit_template(root, pytest.MonkeyPatch())
    with pytest.raises(
        ValueError, match="different tokenizer or chat template"
    ):  # not skipped: re-run, and the old output refused
        pipeline_prepare(config(root))
    again = pipeline_prepare(config(root, f"data.output={root}/prepared-2"))  # the fix the message names
    assert again is not None and again["template_hash"] != first["template_hash"] and again["counts"] == first["counts"]


def _fake_training_run(cfg: RaypipeConfig, manifest_sha256: str) -> None:
    """A real Ray Train run under the launcher's RunConfig whose one checkpoint holds what the training loop writes
    for the resume check: the redacted config and the provenance's manifest and target digests."""
    import ray.train
    from ray.train import ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from raypipe.train.launcher import run_config

    config_doc = redact(cfg.model_dump())
    provenance = {"data_manifest_sha256": manifest_sha256, "target_digest": target_digest(cfg.serve)}

    def loop() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            Path(tmp, "config.json").write_text(json.dumps(config_doc))
            Path(tmp, "provenance.json").write_text(json.dumps(provenance))
            ray.train.report({"train_loss": 1.0, "step": 1}, checkpoint=ray.train.Checkpoint.from_directory(tmp))

    trainer = TorchTrainer(
        loop,
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 0.5}),
        run_config=run_config(cfg),
    )
    assert trainer.fit().error is None


@pytest.mark.integration
def test_a_resume_under_other_train_settings_or_data_is_refused(ray_cluster: str, tmp_path: Path) -> None:
    from raypipe.train.launcher import best_checkpoint, check_resume, latest_checkpoint, run_training

    root = inputs(tmp_path)
    (root / "prepared").mkdir()
    manifest = root / "prepared" / "manifest.json"
    manifest.write_text('{"shards": []}\n')
    cfg = config(root)
    _fake_training_run(cfg, hashlib.sha256(manifest.read_bytes()).hexdigest())

    check_resume(cfg)  # the same settings resume
    check_resume(
        config(root, "train.run.num_workers=1", "train.run.checkpoint_every=7", "serve.num_cpus=1")
    )  # so do other execution settings
    assert latest_checkpoint(cfg).exists("config.json")

    lr = config(root, "train.optim.lr=0.01")
    for call in (check_resume, latest_checkpoint, best_checkpoint, run_training):
        with pytest.raises(
            ValueError,
            match=r"trained with other settings or data \(train\.optim\.lr: 0\.003 there, 0\.01 now\).*name=",
        ):
            call(lr)
    assert not (root / "train" / "replies").exists(), "refused before anything was written"

    manifest.write_text('{"shards": [], "rewritten": true}\n')
    with pytest.raises(ValueError, match=r"data manifest sha256: '[0-9a-f]{64}' there, '[0-9a-f]{64}' now"):
        check_resume(cfg)
