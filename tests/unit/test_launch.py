"""The entry points' process set-up: JAX's persistent compilation cache directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hetd import launch

VARS = (
    "JAX_COMPILATION_CACHE_DIR",
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES",
    "HETD_JAX_CACHE",
    "CACHE_DIRECTORY",
    "XDG_CACHE_HOME",
)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_cache_goes_under_xdg_cache_home_and_caches_every_compilation(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path))
    launch.ensure_compile_cache()
    assert os.environ["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "hetd" / "jax")
    assert (tmp_path / "hetd" / "jax").is_dir()
    assert os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"


def test_systemds_cache_directory_wins(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    clean_env.setenv("CACHE_DIRECTORY", str(tmp_path / "var-cache-hetd"))
    launch.ensure_compile_cache()
    assert os.environ["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "var-cache-hetd" / "jax")


def test_the_users_choice_is_kept(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv("JAX_COMPILATION_CACHE_DIR", "/somewhere/else")
    launch.ensure_compile_cache()
    assert os.environ["JAX_COMPILATION_CACHE_DIR"] == "/somewhere/else"
    clean_env.delenv("JAX_COMPILATION_CACHE_DIR")
    clean_env.setenv("HETD_JAX_CACHE", "0")
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path))
    launch.ensure_compile_cache()
    assert "JAX_COMPILATION_CACHE_DIR" not in os.environ


def test_an_unusable_directory_means_no_cache(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    clean_env.setenv("XDG_CACHE_HOME", str(blocker))
    launch.ensure_compile_cache()
    assert "JAX_COMPILATION_CACHE_DIR" not in os.environ
