"""The curated package fronts of ``hetd.protocol`` and ``hetd.codecs``: every name in ``__all__``
resolves to its submodule's object, and importing ``hetd.protocol`` stays light (its names load
lazily, so a module that needs only :mod:`hetd.protocol.endpoints` pulls in no numpy, msgpack or
policies)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import hetd.codecs
import hetd.protocol
from hetd.codecs import registry
from hetd.protocol import messages, wire


def test_every_protocol_name_resolves_to_its_submodule() -> None:
    where = hetd.protocol._WHERE
    assert sorted(where) == sorted(hetd.protocol.__all__)
    for name in hetd.protocol.__all__:
        value = getattr(hetd.protocol, name)
        sub = importlib.import_module(f"hetd.protocol.{where[name]}")
        assert value is getattr(sub, name), name
    assert hetd.protocol.decode is wire.decode and hetd.protocol.JoinIn is messages.JoinIn


def test_every_codecs_name_is_the_registry_s_or_feedback_s() -> None:
    for name in hetd.codecs.__all__:
        assert getattr(hetd.codecs, name) is not None, name
    assert hetd.codecs.get_codec is registry.get_codec


def test_importing_the_protocol_package_imports_nothing_heavy() -> None:
    code = (
        "import sys, hetd.protocol, hetd.protocol.endpoints; "
        "print(sorted(m for m in ('numpy', 'msgpack', 'policies', 'jax') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
