"""The config loader: search order, the documented example, and loud failures."""

from __future__ import annotations

import os

import pytest

from ckptflow.tasks.config import CkptflowConfig, RetentionConfig, TierConfig, default_config, load_config
from ckptflow.trainer.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "deployments", "ckptflow.example.toml")


def write(tmp_path, text: str, name: str = "ckptflow.toml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_example_file_loads_and_sets_every_section():
    """The documented example is a valid config (it is what users copy)."""
    cfg = load_config(EXAMPLE)
    assert cfg.hot.codec == "none" and cfg.warm.codec == "bytegroup"
    assert cfg.cold.is_s3 and cfg.cold.storage_class == "STANDARD_IA"
    assert cfg.warm.retention.keep_every == 1000 and cfg.cold.retention.keep_best == 3
    assert cfg.prefect.flow_concurrency == 2 and cfg.drill.schedule_cron == "0 3 * * *"
    # relative local paths are resolved against the file's directory, not the cwd
    assert cfg.hot.url == os.path.join(REPO, "deployments", ".ckptflow", "hot")
    assert [t.name for t in cfg.tiers()] == ["hot", "warm", "cold"]


def test_builtin_default_when_nothing_is_configured(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CKPTFLOW_CONFIG", raising=False)
    cfg = load_config()
    assert cfg.hot.url == str(tmp_path / ".ckptflow" / "hot")
    assert cfg.warm.url == str(tmp_path / ".ckptflow" / "warm") and cfg.cold is None
    assert cfg == default_config(str(tmp_path))


def test_search_order_flag_then_env_then_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, '[hot]\nurl = "cwd"\n')
    env = write(tmp_path, '[hot]\nurl = "env"\n', "env.toml")
    flag = write(tmp_path, '[hot]\nurl = "flag"\n', "flag.toml")
    monkeypatch.delenv("CKPTFLOW_CONFIG", raising=False)
    assert load_config().hot.url.endswith("/cwd")
    monkeypatch.setenv("CKPTFLOW_CONFIG", env)
    assert load_config().hot.url.endswith("/env")
    assert load_config(flag).hot.url.endswith("/flag")


@pytest.mark.parametrize(
    "text, key",
    [
        ('[hot]\nurl = "h"\ncodek = "zstd"\n', "'hot.codek'"),
        ('[hot]\nurl = "h"\n[hot.retention]\nkeep_lst = 3\n', "'hot.retention.keep_lst'"),
        ('[hot]\nurl = "h"\n[tiers]\n', "'tiers'"),
        ('[hot]\nurl = "h"\n[drill]\ncron = "x"\n', "'drill.cron'"),
    ],
)
def test_unknown_keys_name_the_key_and_the_file(tmp_path, text, key):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert key in str(e.value) and path in str(e.value)


def test_credentials_in_the_file_are_refused_with_a_hint(tmp_path):
    path = write(tmp_path, '[hot]\nurl = "h"\n[cold]\nurl = "s3://b/p"\naws_secret_access_key = "SECRETVALUE"\n')
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "AWS chain" in str(e.value) and "SECRETVALUE" not in str(e.value)


@pytest.mark.parametrize(
    "text, needle",
    [
        ('[hot]\nurl = "h"\ncodec = "lz4"\n', "hot.codec='lz4'"),
        ('[hot]\nurl = "h"\nlevel = 40\n', "hot.level=40"),
        ('[hot]\nurl = "h"\nmax_concurrency = "8"\n', "hot.max_concurrency = '8' has the wrong type"),
        ('[hot]\nurl = "h"\nstorage_class = "GLACIER"\n', "applies to s3:// tiers only"),
        ('[hot]\nurl = "h"\n[cold]\nurl = "s3://b/p"\nstorage_class = "COLDEST"\n', "cold.storage_class"),
        ('[hot]\nurl = "h"\n[cold]\nurl = "s3://b/p"\nmultipart_chunksize_mb = 1\n', "cold.multipart_chunksize_mb=1"),
        ('[hot]\nurl = "s3://b/hot"\n', "hot.url"),
        ('[hot]\nurl = "h"\n[hot.retention]\nkeep_last = 0\n', "retention.keep_last=0"),
        ('[hot]\nurl = "h"\n[warm]\nurl = "h"\n', "are the same place"),
        ('[warm]\nurl = "w"\n', "missing section [hot]"),
        ('[hot\nurl = "h"\n', "not valid TOML"),
        ('[hot]\nurl = "h"\n[prefect]\nforkserver = "yes"\n', "prefect.forkserver"),
        ('[hot]\nurl = "h"\n[warm]\nurl = "w"\n[export]\nwhen = "often"\n', "export.when='often'"),
        ('[hot]\nurl = "h"\n[export]\nwhen = "every"\n', "needs a [warm] tier"),
        ('[hot]\nurl = "h"\n[warm]\nurl = "w"\n[export]\nwhen = "every_k"\n', "export.every_k=None"),
        ('[hot]\nurl = "h"\n[warm]\nurl = "w"\n[export]\nwhen = "kept"\n', "retention.keep_every"),
        ('[hot]\nurl = "h"\n[warm]\nurl = "w"\n[export]\ndtype = "fp8"\n', "export.dtype='fp8'"),
        ('[hot]\nurl = "h"\n[warm]\nurl = "w"\n[export]\nwhen = "every"\ncold = true\n', "needs a [cold] tier"),
    ],
)
def test_invalid_values_name_field_value_and_file(tmp_path, text, needle):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert needle in str(e.value) and path in str(e.value)


def test_export_selects_steps_by_its_rule(tmp_path):
    from ckptflow.tasks.export import selected

    base = '[hot]\nurl = "h"\n[warm]\nurl = "w"\n[warm.retention]\nkeep_every = 30\n[export]\n'
    every = load_config(write(tmp_path, base + 'when = "every"\n', "a.toml"))
    k = load_config(write(tmp_path, base + 'when = "every_k"\nevery_k = 20\n', "b.toml"))
    kept = load_config(write(tmp_path, base + 'when = "kept"\n', "c.toml"))
    assert selected(every, 7) is None and selected(default_config(str(tmp_path)), 7) is not None
    assert [s for s in (10, 20, 30, 40, 60) if selected(k, s) is None] == [20, 40, 60]
    assert [s for s in (10, 20, 30, 40, 60) if selected(kept, s) is None] == [30, 60]


def test_missing_explicit_files_are_errors(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="--config"):
        load_config(str(tmp_path / "nope.toml"))
    monkeypatch.setenv("CKPTFLOW_CONFIG", str(tmp_path / "gone.toml"))
    with pytest.raises(ConfigError, match="CKPTFLOW_CONFIG"):
        load_config()


def test_retention_that_keeps_nothing_is_refused():
    with pytest.raises(ConfigError, match="keeps nothing"):
        RetentionConfig(keep_last=None)
    assert RetentionConfig(keep_last=None, keep_all=True).keep_all


def test_dataclasses_are_typed_and_secrets_stay_out_of_repr():
    cfg = CkptflowConfig(hot=TierConfig(name="hot", url="/x"))
    cfg.drill.webhook_url = "https://hooks.example/T0KEN"
    assert "T0KEN" not in repr(cfg)
    with pytest.raises(AttributeError):  # slots: a typo in code fails too
        cfg.hot.codex = "zstd"
