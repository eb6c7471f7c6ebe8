"""A trial of msgspec's tagged Structs against hetd's hand-written schema, for reading the two big
frames: a worker's ``push`` and a daemon's ``params``, both of int8-encoded tensors.

Run it by hand (it is no test: pytest does not collect it, and msgspec is no dependency)::

    .venv/bin/pip install msgspec
    .venv/bin/python tests/integration/msgspec_trial.py [--params 1000000 10000000] [--repeat 9]

For each frame and size it prints the median decode time (``timeit``, ``--repeat`` runs of
``--number`` decodes), how the big ``data`` field comes back (a view of the frame, a view of a
fresh buffer, or ``bytes``) and the peak of new memory one decode takes (``tracemalloc``), for:

* ``wire``: :func:`hetd.protocol.frames.decode` (msgpack, the schema checks, the typed record):
  the socket path;
* ``aligned``: :func:`hetd.protocol.aligned.decode_aligned` then :func:`hetd.protocol.frames.read`:
  the shared-memory path (each big ``bin`` copied once, 64-byte aligned, for JAX);
* ``msgspec``: ``msgspec.msgpack.Decoder`` of a tagged union of Structs with ``memoryview``
  binary fields and the same range checks as the schema (``msgspec.Meta``), unknown fields
  forbidden.

The figures and the decision: docs/results/2026-11-28-msgspec-trial.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit
import tracemalloc
from collections.abc import Callable
from functools import partial
from typing import Annotated, Any, Literal

import numpy as np

from hetd.codecs import registry as codecs
from hetd.protocol import frames
from hetd.protocol.aligned import ALIGN, decode_aligned

try:
    import msgspec
except ImportError:  # pragma: no cover - the trial's own dependency
    sys.exit("msgspec is not installed: .venv/bin/pip install msgspec")

TENSORS = 8  # the model's parameters in this many tensors of equal size
BLOCK = 1024  # the int8 codec's elements per scale

# --- the same two messages as msgspec Structs --------------------------------------------------

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Id = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
Seconds = Annotated[float, msgspec.Meta(ge=0)]


class Int8Tensor(msgspec.Struct, forbid_unknown_fields=True):
    """A wire tensor of codec ``int8`` (the codec would still check ``data``'s length)."""

    codec: Literal["int8"]
    dtype: Literal["float32"]
    shape: list[NonNeg]
    bits: Literal[8]
    block: NonNeg
    scales: memoryview
    data: memoryview


class Envelope(msgspec.Struct, tag_field="type", forbid_unknown_fields=True):
    """What every message carries besides its type (the tag)."""

    v: Literal[1]
    id: Id


class PushS(Envelope, tag="push"):
    base: NonNeg
    kind: Literal["grad", "delta"]
    tensors: dict[str, Int8Tensor]
    samples: NonNeg
    steps: Annotated[int, msgspec.Meta(ge=1)]
    compute_s: Seconds
    loss: float | None = None
    free_mem: int | None = None
    pull_s: float | None = None
    sent_at: float | None = None
    idle_s: float | None = None


class ParamsS(Envelope, tag="params"):
    version: NonNeg
    full: bool
    tensors: dict[str, Int8Tensor]
    base: int | None = None
    hash: str | None = None


DECODER = msgspec.msgpack.Decoder(PushS | ParamsS)


def msgspec_decode(frame: bytes) -> PushS | ParamsS:
    """msgspec's decode with the checks its types cannot say (finite floats), as the schema does."""
    msg = DECODER.decode(frame)
    if isinstance(msg, PushS):
        for value in (msg.loss, msg.pull_s, msg.sent_at, msg.idle_s):
            if value is not None and not np.isfinite(value):
                raise ValueError("push: a float field is not finite")
    return msg


# --- frames ----------------------------------------------------------------------------------


def _tensors(n_params: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    size = n_params // TENSORS
    codec = codecs.get_codec("int8", block=BLOCK)
    return {f"layer{i}/w": codec.encode(rng.standard_normal(size, np.float32)) for i in range(8)}


def make_frames(n_params: int) -> dict[str, bytes]:
    """A push and a params frame of ``n_params`` int8 values, as a worker and the daemon pack
    them."""
    tensors = _tensors(n_params)
    push = frames.Push(
        7, 3, "grad", tensors, 32, 1, 0.25, loss=2.5, free_mem=1 << 30, sent_at=1.7e9, idle_s=0.01
    )
    params = frames.Params(4, False, tensors, base=3)
    return {"push": push.encode(), "params": params.encode()}


# --- measuring -------------------------------------------------------------------------------


def _data(decoded: Any) -> Any:
    """The first tensor's ``data`` as the decoder gave it."""
    if isinstance(decoded, PushS | ParamsS):
        return next(iter(decoded.tensors.values())).data
    return next(iter(decoded.tensors.values()))["data"]


def copies(frame: bytes, data: Any) -> str:
    """What the decoder did with the tensor bytes."""
    if isinstance(data, memoryview):
        if data.obj is frame:
            return "view of the frame (no copy)"
        aligned = np.frombuffer(data, np.uint8).ctypes.data % ALIGN == 0
        return "view of a fresh buffer (1 copy" + (", 64-byte aligned)" if aligned else ")")
    return f"{type(data).__name__} (1 copy)"


def peak_bytes(fn: Callable[[], Any]) -> int:
    """New memory at the peak of one call (what it allocates, the frame excluded)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        kept = fn()
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    del kept
    return peak


def median_s(fn: Callable[[], Any], number: int, repeat: int) -> float:
    return statistics.median(timeit.repeat(fn, number=number, repeat=repeat)) / number


DECODERS: dict[str, Callable[[bytes], Any]] = {
    "wire": lambda f: frames.decode(f, len(f) + 1),
    "aligned": lambda f: frames.read(decode_aligned(f, len(f) + 1)),
    "msgspec": msgspec_decode,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--number", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"msgspec {msgspec.__version__}, numpy {np.__version__}, python {sys.version.split()[0]}")
    print("| frame | params | MB | decoder | median ms | data field | peak new MB |")
    print("|---|---|---|---|---|---|---|")
    for n in args.params:
        for kind, frame in make_frames(n).items():
            for name, decode in DECODERS.items():
                decoded = decode(frame)
                assert _data(decoded) is not None
                call = partial(decode, frame)
                ms = 1e3 * median_s(call, args.number, args.repeat)
                peak = peak_bytes(call) / 1e6
                print(
                    f"| {kind} | {n / 1e6:g}M | {len(frame) / 1e6:.1f} | {name} | {ms:.3f} |"
                    f" {copies(frame, _data(decoded))} | {peak:.1f} |"
                )


if __name__ == "__main__":
    main()
