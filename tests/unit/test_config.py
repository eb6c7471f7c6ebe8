"""Configuration: defaults, a TOML file, errors that name the bad key, tokens from the environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetd import config
from hetd.config import Config, ConfigError
from policies.registry import make_policy


@pytest.fixture(autouse=True)
def no_token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A developer's shell may export tokens; start every test without them."""
    monkeypatch.delenv("HETD_WORKER_TOKEN", raising=False)
    monkeypatch.delenv("HETD_ADMIN_TOKEN", raising=False)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hetd.toml"
    path.write_text(text)
    return path


def test_defaults_load_without_a_file() -> None:
    cfg = config.load(None)
    assert cfg == Config()
    assert (cfg.server.port, cfg.train.optimizer, cfg.policy.name) == (7070, "sgd", "auto")
    assert cfg.policy.params == {}
    assert cfg.server.worker_token == "" and cfg.server.admin_token == ""


def test_a_file_naming_only_a_policy_starts_it_with_its_own_defaults(tmp_path: Path) -> None:
    for name in ("asp", "bsp", "ssp", "adsp", "diloco"):
        cfg = config.load(write(tmp_path, f'[policy]\nname = "{name}"\n'))
        assert cfg.policy.params == {}
        make_policy(cfg.policy.name, cfg.policy.params)  # raises on parameters it does not take


def test_a_valid_file_loads(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[server]
host = "0.0.0.0"
port = 9000
heartbeat_s = 1  # an int is fine where a float is expected
worker_token = "w-token"
admin_token = "a-token"

[train]
optimizer = "adam"
lr = 0.001
model_kwargs = { hidden = 64 }

[policy]
name = "bsp"
params = {}

[store]
dir = "/var/lib/hetd"
""",
    )
    cfg = config.load(path)
    assert (cfg.server.host, cfg.server.port) == ("0.0.0.0", 9000)
    assert cfg.server.heartbeat_s == 1.0 and isinstance(cfg.server.heartbeat_s, float)
    assert (cfg.server.worker_token, cfg.server.admin_token) == ("w-token", "a-token")
    assert (cfg.train.optimizer, cfg.train.lr, cfg.train.model_kwargs) == (
        "adam",
        0.001,
        {"hidden": 64},
    )
    assert cfg.train.batch_size == 32  # untouched keys keep their defaults
    assert (cfg.policy.name, cfg.policy.params) == ("bsp", {})
    assert cfg.store.dir == "/var/lib/hetd" and cfg.store.interval_s == 60.0


def test_unknown_section_is_named_with_the_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="workers") as info:
        config.load(write(tmp_path, "[workers]\ncount = 3\n"))
    for section in ("server", "train", "policy", "store"):
        assert section in str(info.value)


def test_unknown_key_is_named_with_the_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="prot") as info:
        config.load(write(tmp_path, "[server]\nprot = 9000\n"))
    message = str(info.value)
    assert "[server]" in message and "port" in message and "admin_token" in message


@pytest.mark.parametrize(
    ("toml", "where"),
    [
        ('[server]\nport = "9000"\n', "port"),
        ("[server]\nport = 9000.0\n", "port"),
        ("[server]\nport = true\n", "port"),
        ("[server]\nhost = 127\n", "host"),
        ('[train]\nlr = "fast"\n', "lr"),
        ("[train]\nlr = false\n", "lr"),
        ("[train]\nmodel_kwargs = 3\n", "model_kwargs"),
        ("[policy]\nparams = [1, 2]\n", "params"),
        ("[store]\ndir = 1979-05-27\n", "dir"),
        ('server = "loopback"\n', "server"),
    ],
)
def test_wrong_types_are_rejected(tmp_path: Path, toml: str, where: str) -> None:
    with pytest.raises(ConfigError, match=where):
        config.load(write(tmp_path, toml))


def test_replace_checks_like_the_file() -> None:
    cfg = config.replace(Config(), "server", port=0)
    assert cfg.server.port == 0
    with pytest.raises(ConfigError, match="port"):
        config.replace(cfg, "server", port="0")
    with pytest.raises(ConfigError, match="colour"):
        config.replace(cfg, "train", colour="red")


def test_env_tokens_override_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, '[server]\nworker_token = "file-w"\nadmin_token = "file-a"\n')
    monkeypatch.setenv("HETD_WORKER_TOKEN", "env-w")
    cfg = config.load(path)
    assert (cfg.server.worker_token, cfg.server.admin_token) == ("env-w", "file-a")
    monkeypatch.setenv("HETD_ADMIN_TOKEN", "env-a")
    cfg = config.load(path)
    assert (cfg.server.worker_token, cfg.server.admin_token) == ("env-w", "env-a")
    assert config.load(None).server.admin_token == "env-a"


def test_equal_worker_and_admin_tokens_are_rejected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError, match="differ"):
        config.load(write(tmp_path, '[server]\nworker_token = "same"\nadmin_token = "same"\n'))
    monkeypatch.setenv("HETD_WORKER_TOKEN", "same")
    monkeypatch.setenv("HETD_ADMIN_TOKEN", "same")
    with pytest.raises(ConfigError, match="differ"):
        config.load(None)


def test_invalid_toml_gives_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="TOML"):
        config.load(write(tmp_path, "[server\nport = \n"))


def test_missing_file_gives_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        config.load(tmp_path / "absent.toml")


def test_non_utf8_file_gives_config_error(tmp_path: Path) -> None:
    """BUG (config.load): tomllib raises UnicodeDecodeError, which is not caught."""
    path = tmp_path / "latin1.toml"
    path.write_bytes('[server]\nhost = "caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(ConfigError):
        config.load(path)


def test_replace_rejects_equal_tokens() -> None:
    """BUG (config.replace): the token check lives only in with_env, so replace() skips it."""
    with pytest.raises(ConfigError, match="differ"):
        config.replace(Config(), "server", worker_token="same", admin_token="same")


@pytest.mark.parametrize("spec", ["int9", "int8:blok=1024", "int8:block=3", "topk:k=2"])
def test_a_bad_codec_spec_stops_start_up_naming_the_key(spec: str) -> None:
    with pytest.raises(ConfigError, match=r"\[train\] codec"):
        config.replace(Config(), "train", codec=spec)


def test_a_good_codec_spec_loads() -> None:
    assert (
        config.replace(Config(), "train", codec="int8:block=1024").train.codec == "int8:block=1024"
    )


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::"])
def test_a_public_host_needs_a_worker_token(host: str) -> None:
    public = config.replace(Config(), "server", host=host)  # an admin client may read it
    with pytest.raises(ConfigError, match="worker_token"):
        config.check_serving(public)  # a daemon may not listen on it
    with pytest.raises(ConfigError, match="worker_token"):  # open workers: loopback only
        config.check_serving(config.replace(public, "server", open_workers=True))
    tokens = {"worker_token": "w" * 16, "admin_token": "a" * 16}
    cfg = config.replace(Config(), "server", host=host, **tokens)
    config.check_serving(cfg)
    assert cfg.server.host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_loopback_runs_without_a_worker_token_only_when_opted_in(host: str) -> None:
    cfg = config.replace(Config(), "server", host=host)
    with pytest.raises(ConfigError, match="open_workers = true"):
        config.check_serving(cfg)
    cfg = config.replace(cfg, "server", open_workers=True)
    config.check_serving(cfg)
    assert cfg.server.worker_token == ""


def test_downlink_takes_one_of_three_modes() -> None:
    for mode in ("auto", "delta", "full"):
        assert config.replace(Config(), "train", downlink=mode).train.downlink == mode
    with pytest.raises(ConfigError, match=r"\[train\] downlink = 'fast': one of auto, delta, full"):
        config.replace(Config(), "train", downlink="fast")


@pytest.mark.parametrize(
    ("host", "local"),
    [
        ("127.0.0.1", True),
        ("127.5.0.9", True),
        ("localhost", True),
        ("::1", True),
        ("0.0.0.0", False),
        ("10.1.2.3", False),
        ("::", False),
        ("head.example", False),
        (None, False),
    ],
)
def test_is_loopback_for_listen_hosts_and_peer_addresses(host: str | None, local: bool) -> None:
    assert config.is_loopback(host) is local


def test_the_readme_configuration_block_shows_the_real_defaults() -> None:
    """README's "Configuration" says its block is the defaults: every key in it must be one."""
    import dataclasses
    import re
    import tomllib
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("### Configuration", 1)[1].split("\n### ", 1)[0]
    block = re.search(r"```toml\n(.*?)```", section, re.S)
    assert block is not None, "no toml block under ### Configuration"
    shown = tomllib.loads(block.group(1))
    defaults = dataclasses.asdict(config.Config())
    assert set(shown) == set(defaults), set(shown) ^ set(defaults)
    for name, keys in shown.items():
        for key, value in keys.items():
            assert key in defaults[name], f"[{name}] {key} is no key"
            assert value == defaults[name][key], f"[{name}] {key}: shown {value!r}"
