"""What a worker may import (:mod:`workers.imports`): bundled names always, a plug-in only when
its operator named it, and then only that one; ``--model``/``--dataset`` and ``[worker]`` keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from workers.cli import parser, read_allowed
from workers.imports import Allowed, ImportRefused, check_imports, operator_flags


def _setup(model: Any, dataset: Any = "digits") -> dict[str, Any]:
    return {"model": {"spec": model, "kwargs": {}}, "dataset": {"spec": dataset, "kwargs": {}}}


@pytest.mark.parametrize(
    ("model", "dataset"),
    [("mlp", "digits"), ("cnn", "mnist5k"), ("transformer", "pydoc"), ("no-such", "x")],
)
def test_registered_names_need_no_word(model: str, dataset: str) -> None:
    check_imports(_setup(model, dataset), None)  # a name is a table lookup, never an import


def test_the_bundled_block_model_needs_no_word() -> None:
    check_imports(_setup("hetd.zoo.blocks:mlp_model"), None)


@pytest.mark.parametrize(
    "spec",
    ["subprocess:getoutput", "hetd.cli.main:main", "hetd.zoo.data:resolve_spec", "os:system"],
)
def test_any_other_plug_in_is_refused_naming_the_flag(spec: str) -> None:
    with pytest.raises(ImportRefused, match=f"plug-in model '{spec}'.*--model {spec} "):
        check_imports(_setup(spec), None)
    with pytest.raises(ImportRefused, match=f"plug-in data set '{spec}'.*--dataset {spec} "):
        check_imports(_setup("mlp", spec), None)


def test_a_named_plug_in_is_allowed_and_compared() -> None:
    mine = Allowed(model="mine.models:net", dataset="mine.data:load")
    check_imports(_setup("mine.models:net", "mine.data:load"), mine)
    with pytest.raises(ImportRefused, match=r"trains the model 'other:net' but .* --model mine"):
        check_imports(_setup("other:net", "mine.data:load"), mine)
    with pytest.raises(ImportRefused, match="trains the model 'mlp' but"):
        check_imports(_setup("mlp", "mine.data:load"), mine)  # named: that model or none
    with pytest.raises(ImportRefused, match="plug-in data set 'x:y'"):
        check_imports(_setup("mine.models:net", "x:y"), Allowed(model="mine.models:net"))


def test_odd_specs_are_refused_and_shown_short() -> None:
    with pytest.raises(ImportRefused, match="no usable model"):
        check_imports(_setup(["subprocess:getoutput"]), None)
    with pytest.raises(ImportRefused) as info:
        check_imports(_setup("m:" + "a" * 10_000), None)
    assert len(str(info.value)) < 700
    with pytest.raises(ImportRefused, match=r"--model 'a b:c; rm'"):
        check_imports(_setup("a b:c; rm"), None)  # quoted as a shell would need it


def test_the_command_line_and_the_config_name_plug_ins(tmp_path: Path) -> None:
    url = "ws://127.0.0.1:7070"
    assert read_allowed(parser().parse_args([url])) == Allowed()
    args = parser().parse_args([url, "--model", "a.b:m", "--dataset", "a.b:d"])
    assert read_allowed(args) == Allowed("a.b:m", "a.b:d")
    conf = tmp_path / "worker.toml"
    conf.write_text('[worker]\ntoken = "t"\nmodel = "c.d:m"\ndataset = "c.d:d"\n')
    assert read_allowed(parser().parse_args([url, "--config", str(conf)])) == Allowed(
        "c.d:m", "c.d:d"
    )
    args = parser().parse_args([url, "--config", str(conf), "--model", "a.b:m"])
    assert read_allowed(args) == Allowed("a.b:m", "c.d:d")  # the flag wins
    with pytest.raises(ValueError, match="--task and --model/--dataset do not go together"):
        read_allowed(parser().parse_args([url, "--task", "t.py:task", "--model", "a.b:m"]))
    conf.write_text("[worker]\nmodel = 3\n")
    with pytest.raises(ValueError, match=r"\[worker\] model must be a string"):
        read_allowed(parser().parse_args([url, "--config", str(conf)]))


def test_a_launcher_passes_the_flags_for_what_it_named() -> None:
    """``hetd demo`` and ``hetd bench --mode real`` name the model and data set themselves: their
    workers get the flags for plug-ins, none for bundled names."""
    assert operator_flags("mlp", "digits") == []
    assert operator_flags("hetd.zoo.blocks:mlp_model", "x.y:data") == ["--dataset", "x.y:data"]
    flags = operator_flags("a.b:net", "mnist5k")
    assert flags == ["--model", "a.b:net"]
    allowed = read_allowed(parser().parse_args(["ws://127.0.0.1:7070", *flags]))
    check_imports(_setup("a.b:net", "mnist5k"), allowed)
