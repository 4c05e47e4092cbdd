"""The Hugging Face ``Trainer`` with ckptflow: the real ``transformers`` trains a tiny GPT-2 built from
a config, on CPU. ``CkptflowCallback`` adopts each ``checkpoint-N`` as the Trainer writes it, the
lifecycle takes it to cold, and after the machine is lost (output folder, hot and warm gone)
``latest_verified`` fetches it back from cold and the Trainer resumes to the uninterrupted run's
losses. ``ckptflow adopt`` catches a folder still being written, and the parse check and the user's
own check a damaged one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

from ckptflow.trainer.format import layout
from ckptflow.trainer.format.commit import committed_steps
from tests.helpers import PY, REPO, adopt_cli, cold_steps, run_script, script_result, write_config

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
    dataloader_num_workers=0, disable_tqdm=True, save_total_limit=1,
)
callbacks = []
if os.environ.get("RUN_ID"):
    from ckptflow.integrations.transformers import CkptflowCallback
    callbacks.append(CkptflowCallback(os.environ["RUN_ID"]))
tr = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
resume = os.environ.get("RESUME")
if resume == "latest":
    from ckptflow.integrations.transformers import latest_verified
    resume = latest_verified(os.environ["OUT"], run_id="hf")
    print("RESUMED " + json.dumps(resume))
tr.train(resume_from_checkpoint=resume or None)
logged = [h for h in tr.state.log_history if "loss" in h]
print("RESULT " + json.dumps({"step": tr.state.global_step, "losses": {h["step"]: h["loss"] for h in logged}}))
"""


def _train(out, steps: int, resume: str = "", env: dict | None = None) -> dict:
    r = run_script(TRAIN, {"OUT": str(out), "MAX_STEPS": str(steps), "RESUME": resume, **(env or {})}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return {**script_result(r.stdout), "stderr": r.stderr}


def test_the_callback_adopts_each_checkpoint_and_a_lost_machine_resumes_from_cold_to_the_same_losses(
    prefect_api, s3_endpoint, s3_bucket, tmp_path, capsys
):
    from ckptflow.flows.drill import drill_tier
    from ckptflow.flows.lifecycle import lifecycle
    from ckptflow.integrations.transformers import latest_verified
    from ckptflow.tasks.adopt import parse_check
    from ckptflow.tasks.config import load_config
    from ckptflow.tasks.drill import drill_one
    from ckptflow.trainer.events import read_outbox
    from ckptflow.trainer.format.manifest import read_manifest

    hot, out = tmp_path / "hot", tmp_path / "hf"
    check = "tests.loops.adopted_checks:hf_weights_finite"  # the user's own check, after the parse
    cfg = write_config(tmp_path, hot, s3_endpoint, s3_bucket, lifecycle=f'adopted_check = "{check}"')
    env = {"RUN_ID": "hf", "CKPTFLOW_CONFIG": cfg, "PREFECT_API_URL": prefect_api}
    full = _train(out, 6, env=env)
    run = hot / "hf"
    assert committed_steps(str(run)) == [6, 4, 2] and [r["step"] for r in read_outbox(str(run))] == [2, 4, 6]
    assert os.listdir(out) == ["checkpoint-6"]  # save_total_limit=1 trims the Trainer's folder, not ckptflow's
    step4 = run / layout.step_name(4)
    m = read_manifest(str(step4))
    m_bytes = (step4 / layout.MANIFEST).read_bytes()
    assert m.extra["adopted"]["format"] == "hf_trainer"
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= set(m.files)
    res = parse_check(str(step4), m)
    assert res["ok"], res
    assert "training_args.bin" in res["not_parsed"] and "optimizer.pt" not in res["not_parsed"]

    done = lifecycle(run_id="hf", step=4, uri=str(step4), config=cfg)
    assert done["status"] == "done" and done["verify"]["sanity"]["check"] == "parse", done
    user = done["verify"]["sanity"]["user_check"]
    assert user["ok"] and user["check"] == check and user["details"]["tensors"] > 0, user
    drilled = drill_one(drill_tier(load_config(cfg)), "hf", 4)  # the drill: cold -> scratch -> parse
    assert drilled.ok and drilled.tier == "cold", drilled
    assert 4 in cold_steps(s3_endpoint, s3_bucket, "hf")

    # The newest copy that verifies, in place on hot; a damaged one is passed over for the step before.
    assert latest_verified(str(out), run_id="hf", config=cfg) == str(run / layout.step_name(6))
    assert f"ckptflow: hf resumes from step 6, from hot: {run / layout.step_name(6)}" in capsys.readouterr().err
    with open(run / layout.step_name(6) / "model.safetensors", "r+b") as f:
        f.write(b"\0" * 64)
    assert latest_verified(str(out), run_id="hf", config=cfg) == str(step4)

    _partial_and_damaged_are_caught(out / "checkpoint-6", tmp_path)

    # The machine is lost: the Trainer's folder, hot and warm. Step 4 comes back from cold, and the
    # Trainer resumes from it to the uninterrupted run's losses (same data order, RNG, optimizer).
    for gone in (out, hot, tmp_path / "warm"):
        shutil.rmtree(gone)
    resumed = _train(out, 6, resume="latest", env={"CKPTFLOW_CONFIG": cfg})
    assert resumed["step"] == 6
    assert "ckptflow: hf resumes from step 4, from the cold tier (s3://" in resumed["stderr"], resumed["stderr"]
    assert os.listdir(out) == ["checkpoint-6"], "it trained steps 5-6 only; nothing else is written there"
    assert [resumed["losses"][s] for s in ("5", "6")] == [full["losses"][s] for s in ("5", "6")], (resumed, full)
    # brought back into the hot root under the tiers' manifest: the lifecycle sees the checkpoint it carried
    assert committed_steps(str(run)) == [4]
    assert (run / layout.step_name(4) / layout.MANIFEST).read_bytes() == m_bytes
    verify = [PY, "-m", "ckptflow.cli.main", "verify", str(run / layout.step_name(4))]
    v = subprocess.run(verify, cwd=REPO, capture_output=True, text=True)
    assert v.returncode == 0, v.stdout + v.stderr

    # Every process of a job asks at once (each rank calls latest_verified): one fetches, the other finds it on hot
    shutil.rmtree(hot)
    capsys.readouterr()
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda _: latest_verified(str(out), run_id="hf", config=cfg), range(2)))
    assert got == [str(step4)] * 2
    said = capsys.readouterr().err
    assert said.count("from the cold tier") == 1 and said.count("from step 4, from hot") == 1, said


def _partial_and_damaged_are_caught(src, tmp_path) -> None:
    """A copy of ``src`` still being written is refused; a damaged one is adopted (bytes are bytes)
    and then fails the parse check and the user's own check."""
    from ckptflow.tasks.adopt import parse_check
    from ckptflow.tasks.verify import run_adopted_check
    from ckptflow.trainer.format.manifest import read_manifest

    partial = tmp_path / "partial" / "checkpoint-6"
    shutil.copytree(src, partial)
    os.remove(partial / "trainer_state.json")  # the Trainer writes it last
    hot = tmp_path / "hot2"
    r = adopt_cli(str(partial), "--run-id", "hf", "--root", str(hot))
    assert r.returncode == 2 and "still being written" in r.stderr and str(partial) in r.stderr, r.stderr
    assert committed_steps(str(hot / "hf")) == []

    damaged = tmp_path / "damaged" / "checkpoint-6"
    shutil.copytree(src, damaged)
    with open(damaged / "model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(damaged / "model.safetensors") - 10)
    assert adopt_cli(str(damaged), "--run-id", "hf", "--root", str(hot)).returncode == 0
    final = hot / "hf" / layout.step_name(6)
    res = parse_check(str(final), read_manifest(str(final)))
    assert not res["ok"] and any("model.safetensors" in p for p in res["problems"]), res
    assert json.dumps(res)  # the verify record is JSON
    user = run_adopted_check("tests.loops.adopted_checks:hf_weights_finite", str(final))
    assert not user["ok"] and "hf_weights_finite" in user["problems"][0], user
