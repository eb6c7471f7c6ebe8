"""Text from the trained language model: :func:`hetd.zoo.lm.generate` on a tiny transformer that
learned a periodic text (greedy continues it, past its context window too), seeded sampling, and
the demo's samples and result lines for a language model."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
import pytest

from hetd.local.demo import DemoOptions, reached_target, result_text, write_samples
from hetd.zoo.lm import generate
from hetd.zoo.models import get_model

# Its module fixture trains the language model for seconds: `make test` runs it, `make test-fast`
# does not.
pytestmark = pytest.mark.slow

TINY = {"d_model": 32, "layers": 1, "heads": 2}
CONTEXT = 16
TEXT = b"hello world. " * 40


def _trained() -> tuple[Any, dict[str, Any]]:
    """A tiny LM fitted to TEXT (a 13-byte period) by 200 Adam steps."""
    model = get_model("transformer", 256, **TINY)
    params = jax.jit(model.init, static_argnums=1)(jax.random.PRNGKey(0), (CONTEXT,))
    stream = np.frombuffer(TEXT, np.uint8)
    rows = np.arange(64)[:, None] + np.arange(CONTEXT + 1)[None, :]
    x = stream[rows][:, :-1].astype(np.float32)
    y = stream[rows][:, 1:].astype(np.int32)
    opt = optax.adam(0.02)

    @jax.jit
    def step(p: Any, s: Any) -> tuple[Any, Any, Any]:
        loss, g = jax.value_and_grad(model.loss)(p, x, y)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    state = opt.init(params)
    for _ in range(200):
        params, state, loss = step(params, state)
    assert float(loss) < 0.05  # it knows the text
    return model, params


@pytest.fixture(scope="module")
def trained() -> tuple[Any, dict[str, Any]]:
    return _trained()


def test_greedy_text_continues_what_the_model_learned(trained: tuple[Any, Any]) -> None:
    model, params = trained
    # 40 bytes from a 5-byte prompt: the window fills up (16) and then slides
    out = generate(model.logits, params, b"hello", CONTEXT, 40)
    assert len(out) == 40
    assert b"hello" + out == TEXT[: 5 + 40]
    # from the middle of the period, with the prompt longer than the context
    start = TEXT[3 : 3 + 20]
    assert generate(model.logits, params, start, CONTEXT, 13) == TEXT[23 : 23 + 13]


def test_sampling_follows_its_seed_and_temperature(trained: tuple[Any, Any]) -> None:
    model, params = trained
    a = generate(model.logits, params, b"hel", CONTEXT, 24, temperature=1.5, seed=3)
    b = generate(model.logits, params, b"hel", CONTEXT, 24, temperature=1.5, seed=3)
    assert a == b and len(a) == 24
    # a near-zero temperature samples what greedy picks
    cold = generate(model.logits, params, b"hel", CONTEXT, 24, temperature=1e-3, seed=5)
    assert cold == generate(model.logits, params, b"hel", CONTEXT, 24)
    # an untrained model at temperature 1 writes something other than the learned text
    fresh = get_model("transformer", 256, **TINY).init(jax.random.PRNGKey(9), (CONTEXT,))
    noise = generate(model.logits, fresh, b"hel", CONTEXT, 24, temperature=1.0, seed=0)
    assert noise != TEXT[3:27]


def test_generate_checks_its_arguments(trained: tuple[Any, Any]) -> None:
    model, params = trained
    with pytest.raises(ValueError, match="prompt"):
        generate(model.logits, params, b"", CONTEXT, 4)
    with pytest.raises(ValueError, match="temperature"):
        generate(model.logits, params, b"a", CONTEXT, 4, temperature=-1.0)
    assert generate(model.logits, params, b"a", CONTEXT, 0) == b""


def test_the_demo_writes_samples_and_reports_a_loss_target(trained: tuple[Any, Any]) -> None:
    _, params = trained
    opts = DemoOptions(
        model="transformer",
        model_kwargs=tuple(TINY.items()),
        dataset="pydoc",
        target_loss=2.6,
        prompt="hello",
        sample_bytes=26,
        temperatures=(0.0, 0.8),
    )
    samples = write_samples(opts, dict(params))
    assert [s["temperature"] for s in samples] == [0.0, 0.8]
    assert samples[0]["text"] == TEXT[5:31].decode()  # greedy: the learned text
    assert all(len(s["text"].encode()) >= 1 for s in samples)
    assert reached_target(opts, 2.5, 0.1) and not reached_target(opts, 2.7, 0.99)
    assert not reached_target(DemoOptions(), 0.01, 0.5)  # the MLP demo: an accuracy target
    assert write_samples(DemoOptions(), {}) == []  # no prompt, no language model: no samples
    summary = {
        "target_loss": 2.6,
        "target_accuracy": None,
        "time_to_target_s": 12.5,
        "stop_loss": 2.58,
        "stop_version": 40,
        "final_loss": 2.55,
        "final_accuracy": 0.3,
        "final_version": 44,
        "elapsed_s": 12.6,
        "updates_applied": 44,
        "pushes_per_s": 3.5,
        "first_update_s": 2.0,
        "daemon_build_s": 1.0,
        "samples": samples,
    }
    text = result_text(summary)
    assert "target 2.6 reached at 12.5s: test loss 2.5800 at version 40" in text
    assert "final model: test loss 2.5500" in text
    assert "--- the model writes after 'hello' (greedy):\nhello" + TEXT[5:31].decode() in text
    assert "(temperature 0.8)" in text
