"""A Hugging Face ``Trainer`` checkpoint adopted: the real ``transformers`` writes ``checkpoint-N/``
(a tiny GPT-2 built from a config, on CPU), ``ckptflow adopt`` commits it, its files parse without a
pickle, and the Trainer resumes from the adopted copy to the same losses as the run it came from."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

from ckptflow.trainer.format import layout
from ckptflow.trainer.format.commit import committed_steps
from tests.helpers import PY, REPO, run_script, script_result, torchrun_env

TRAIN = """
import json, os, torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16))
g = torch.Generator().manual_seed(1)
data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 64, (48, 16), generator=g)]
args = TrainingArguments(
    output_dir=os.environ["OUT"], max_steps=int(os.environ["MAX_STEPS"]), save_steps=2,
    per_device_train_batch_size=4, report_to=[], use_cpu=True, logging_steps=1, seed=0,
    dataloader_num_workers=0, disable_tqdm=True,
)
tr = Trainer(model=model, args=args, train_dataset=data)
tr.train(resume_from_checkpoint=os.environ.get("RESUME") or None)
logged = [h for h in tr.state.log_history if "loss" in h]
print("RESULT " + json.dumps({"step": tr.state.global_step, "losses": {h["step"]: h["loss"] for h in logged}}))
"""


def _train(out, steps: int, resume: str = "") -> dict:
    r = run_script(TRAIN, {"OUT": str(out), "MAX_STEPS": str(steps), "RESUME": resume}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return script_result(r.stdout)


def _adopt(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "ckptflow.cli.main", "adopt", *args],
        cwd=REPO,
        env=torchrun_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_trainer_checkpoint_is_adopted_parses_and_resumes_to_the_same_losses(tmp_path):
    from ckptflow.tasks.adopt import parse_check
    from ckptflow.trainer.format.manifest import read_manifest

    full = _train(tmp_path / "hf", 6)
    src = tmp_path / "hf" / "checkpoint-4"
    hot = tmp_path / "hot"
    r = _adopt(str(src), "--run-id", "hf", "--root", str(hot), "--json")
    assert r.returncode == 0, r.stderr
    final = hot / "hf" / layout.step_name(4)
    m = read_manifest(str(final))
    assert m.extra["adopted"]["format"] == "hf_trainer"
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= set(m.files)
    res = parse_check(str(final), m)
    assert res["ok"], res
    assert "training_args.bin" in res["not_parsed"] and "optimizer.pt" not in res["not_parsed"]
    v = subprocess.run([PY, "-m", "ckptflow.cli.main", "verify", str(final)], cwd=REPO, capture_output=True, text=True)
    assert v.returncode == 0, v.stdout + v.stderr

    # The real consumer: the Trainer resumes from the adopted copy, and the steps after it are the
    # uninterrupted run's (same data order, RNG and optimizer state).
    resumed = _train(tmp_path / "again", 6, resume=str(final))
    assert resumed["step"] == 6 and os.listdir(tmp_path / "again") == ["checkpoint-6"], "it trained steps 5-6 only"
    assert [resumed["losses"][s] for s in ("5", "6")] == [full["losses"][s] for s in ("5", "6")], (resumed, full)


def test_a_trainer_checkpoint_still_being_written_or_damaged_is_caught(tmp_path):
    from ckptflow.tasks.adopt import parse_check
    from ckptflow.trainer.format.manifest import read_manifest

    _train(tmp_path / "hf", 2)
    src = tmp_path / "hf" / "checkpoint-2"
    partial = tmp_path / "partial" / "checkpoint-2"
    shutil.copytree(src, partial)
    os.remove(partial / "trainer_state.json")  # the Trainer writes it last
    hot = tmp_path / "hot"
    r = _adopt(str(partial), "--run-id", "hf", "--root", str(hot))
    assert r.returncode == 2 and "still being written" in r.stderr and str(partial) in r.stderr, r.stderr
    assert committed_steps(str(hot / "hf")) == []

    damaged = tmp_path / "damaged" / "checkpoint-2"
    shutil.copytree(src, damaged)
    with open(damaged / "model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(damaged / "model.safetensors") - 10)
    assert _adopt(str(damaged), "--run-id", "hf", "--root", str(hot)).returncode == 0  # bytes are bytes
    final = hot / "hf" / layout.step_name(2)
    res = parse_check(str(final), read_manifest(str(final)))
    assert not res["ok"] and any("model.safetensors" in p for p in res["problems"]), res
    assert json.dumps(res)  # the verify record is JSON
