"""The export: a checkpoint's model as Hugging Face-style sharded safetensors.

By hand (``ckptflow export``, run as a user runs it) and as the lifecycle's stage (in-process
against the session's Prefect server and moto, as in ``test_adopt.py``); read back by
``safetensors.torch.load_file`` and by a ``transformers`` model's ``from_pretrained``. The
lifecycle under a deployed worker exports in the demo (tests/e2e/test_demo.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import torch

from ckptflow.trainer.events import EXPORTED, resource_id
from ckptflow.trainer.format import layout
from tests.helpers import PY, REPO, adopt_cli, flip_byte, forked_cli, server_event, torchrun_env, write_config


def export_cli(*args: str) -> subprocess.CompletedProcess:
    """``ckptflow export ARGS`` through the console script's entry, in a forked child with a child's environment."""
    r = forked_cli(["export", *args], environ=torchrun_env(), cwd=REPO, timeout=120)
    assert not r.hung, f"ckptflow export {' '.join(args)} hung"
    return subprocess.CompletedProcess(["ckptflow", "export", *args], r.code, r.out, r.err)


def _shards(out: str) -> dict[str, torch.Tensor]:
    """Every tensor of an export, each shard read by safetensors itself, as the index maps them."""
    from safetensors.torch import load_file

    index = json.loads(open(os.path.join(out, "model.safetensors.index.json")).read())
    got: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        part = load_file(os.path.join(out, name))
        assert all(index["weight_map"][k] == name for k in part)
        got.update(part)
    assert sorted(got) == sorted(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
    return got


def _saved_model(step_dir: str, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """The checkpoint's model tensors as plain DCP loads them (what the export must equal)."""
    import torch.distributed.checkpoint as dcp

    from ckptflow.trainer.format.dcpmeta import read_dcp_metadata

    md = read_dcp_metadata(step_dir)
    want = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if k.startswith(prefix) and hasattr(v, "size")
    }
    dcp.load(want, checkpoint_id=step_dir, no_dist=True)
    return {k[len(prefix) :]: v for k, v in want.items()}


def test_export_by_hand_is_bitwise_sharded_and_refuses_bad_input_leaving_nothing(tiny_run, tmp_path):
    """``ckptflow export``: every tensor bitwise, in shards no larger than asked (but a tensor
    bigger than that alone), bf16 exactly the cast; a damaged checkpoint, a prefix naming nothing
    and an existing OUT are refused with the file or the fix named, and leave no folder behind."""
    step = os.path.join(tiny_run, layout.step_name(6))
    saved = _saved_model(step)
    out = str(tmp_path / "export")
    r = export_cli(step, out, "--shard-mb", "0.1", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    got = _shards(out)
    assert sorted(got) == sorted(saved) and all(torch.equal(got[k], saved[k]) for k in saved)
    big = max(t.numel() * t.element_size() for t in saved.values())
    assert len(res["shards"]) > 2 and res["step"] == 6
    for name in res["shards"]:  # a shard over the limit holds one tensor, the one over it alone
        size = os.path.getsize(os.path.join(out, name))
        assert size <= 0.1 * 2**20 + 8192 or size <= big + 8192, (name, size)
    rec = json.loads(open(os.path.join(out, "export.json")).read())
    assert rec["source"]["step"] == 6 and set(rec["files"]) == {*res["shards"], "model.safetensors.index.json"}

    half = str(tmp_path / "bf16")
    r = export_cli(step, half, "--dtype", "bf16")
    assert r.returncode == 0 and "exported step 6" in r.stdout, r.stderr
    got = _shards(half)
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], saved[k].to(torch.bfloat16)) for k in saved)

    r = export_cli(step, out)
    assert r.returncode == 4 and "already exists" in r.stderr
    r = export_cli(step, str(tmp_path / "none"), "--prefix", "encoder.")
    assert r.returncode == 4 and "--prefix" in r.stderr and "model." in r.stderr, r.stderr
    bad = tmp_path / "bad"
    shutil.copytree(step, bad)
    victim = sorted(n for n in os.listdir(bad) if n.endswith(".distcp"))[0]
    flip_byte(str(bad / victim))
    r = export_cli(str(bad), str(tmp_path / "from-bad"))
    assert r.returncode == 1 and victim in r.stderr, r.stderr
    assert not [n for n in os.listdir(tmp_path) if n.startswith("from-bad") or n.startswith("none")]


HF_JOB = """
import os, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from ckptflow.trainer.distenv import exit_process
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

dist.init_process_group("gloo")
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=False)
model = LlamaForCausalLM(cfg)
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for _ in range(3):
    ids = torch.randint(0, 96, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step(); opt.zero_grad()
state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
dcp.save(state, checkpoint_id=os.environ["OUT"])
if dist.get_rank() == 0:
    cfg.save_pretrained(os.environ["CFG"])
dist.barrier()
dist.destroy_process_group()
exit_process(0)  # no interpreter finalization racing gloo's threads (a SIGABRT seen here)
"""


def test_the_lifecycle_exports_an_fsdp_checkpoint_that_transformers_loads_with_the_same_logits(
    prefect_api, s3_endpoint, s3_bucket, tmp_path
):
    """A Llama model (built from a config) trained under FSDP2 on 2 ranks and saved with
    ``dcp.save``, adopted, then its lifecycle with ``[export]``: the export stage consolidates the
    shards into safetensors on warm and cold and announces ``ckptflow.checkpoint.exported``;
    ``from_pretrained`` on it gives bitwise the logits of the model restored from the checkpoint."""
    import boto3
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from ckptflow.flows.lifecycle import lifecycle

    src, hf = tmp_path / "job" / "step-5", tmp_path / "hf-config"
    script = tmp_path / "job.py"
    script.write_text(HF_JOB)
    job = subprocess.run(
        [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)],
        cwd=REPO,
        env=torchrun_env({"OUT": str(src), "CFG": str(hf)}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert job.returncode == 0, job.stderr[-3000:]
    hot = tmp_path / "hot"
    r = adopt_cli(str(src), "--run-id", "llama", "--root", str(hot), "--json")
    assert r.returncode == 0, r.stderr
    uri = json.loads(r.stdout)["uri"]
    cfg = write_config(
        tmp_path, hot, s3_endpoint, s3_bucket, lifecycle='[export]\nwhen = "every"\nshard_mb = 0.05\ncold = true'
    )
    done = lifecycle(run_id="llama", step=5, uri=uri, config=cfg)
    assert done["status"] == "done", done
    ex = done["export"]
    assert ex["exported"] and len(ex["shards"]) > 1 and ex["cold"].startswith(f"s3://{s3_bucket}/"), ex
    ev = server_event(prefect_api, resource_id("llama", 5), EXPORTED)  # what an evaluation job triggers on
    assert ev["payload"]["location"] == ex["location"] and ev["payload"]["index"].endswith(".index.json")
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id="x", aws_secret_access_key="x")
    key = ex["cold"].split("/", 3)[3]
    names = {o["Key"].rsplit("/", 1)[1] for o in s3.list_objects_v2(Bucket=s3_bucket, Prefix=key)["Contents"]}
    assert {*ex["shards"], "model.safetensors.index.json", "export.json", layout.COMMIT_MARKER} <= names

    model_dir = tmp_path / "model"  # the export plus the model's config, as a model repo holds them
    shutil.copytree(ex["location"], model_dir)
    shutil.copy(hf / "config.json", model_dir / "config.json")
    exported = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    restored = LlamaForCausalLM(LlamaConfig.from_pretrained(str(hf))).eval()
    sd = {"model": restored.state_dict()}
    dcp.load(sd, checkpoint_id=str(src), no_dist=True)
    restored.load_state_dict(sd["model"])
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(exported(input_ids=ids).logits, restored(input_ids=ids).logits)
