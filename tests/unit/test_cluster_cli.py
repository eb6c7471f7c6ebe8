"""hetd cluster's config for the head (no Ray needed): the operator's file with the pservers the
cluster runs, its state directory made absolute, written back as TOML that reads the same."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from hetd import config as config_mod
from hetd.cli.cluster import head_config
from hetd.config import toml_text


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "conf" / "hetd.toml"
    path.parent.mkdir()
    path.write_text(text)
    return path


def test_the_head_config_runs_the_pservers_on_ray_from_an_absolute_state_dir(
    tmp_path: Path,
) -> None:
    path = _write(
        tmp_path,
        '[server]\nport = 7170\nopen_workers = true\n[train]\noptimizer = "momentum"\n'
        '[policy]\nname = "ssp"\nparams = { staleness = 3 }\n'
        '[store]\ndir = "state"\n[pservers]\nport = 7172\nbackend = "local"\n',
    )
    raw = head_config(path, 3)
    assert raw["pservers"] == {"port": 7172, "backend": "ray", "log": True, "servers": 3}
    assert raw["store"]["dir"] == str(tmp_path / "conf" / "state")  # beside the file, absolute
    assert tomllib.loads(toml_text(raw)) == raw  # what the head's actor reads
    cfg = config_mod.from_mapping(tomllib.loads(toml_text(raw)))
    assert cfg.policy.params == {"staleness": 3} and cfg.pservers.servers == 3


def test_the_head_config_says_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(config_mod.ConfigError, match=r"\[store\] dir is needed"):
        head_config(_write(tmp_path, "[server]\nport = 7170\n"), 2)
    path = tmp_path / "conf" / "hetd.toml"
    with pytest.raises(config_mod.ConfigError, match="--pservers must be >= 1"):
        head_config(path, 0)
    with pytest.raises(config_mod.ConfigError, match="cannot read config"):
        head_config(tmp_path / "missing.toml", 2)
    path.write_text('[store]\ndir = "s"\n[train]\noptimizer = "nope"\n')
    with pytest.raises(config_mod.ConfigError, match="optimizer"):  # checked as hetd serve checks
        head_config(path, 2)
