"""The efficiency model per optimizer family (policies.efficiency.for_optimizer): which model an
optimizer spec, with its options, gets, and the orderings the plain-SGD model implies."""

from __future__ import annotations

from typing import NamedTuple

import pytest

from policies.efficiency import ADAM, PLAIN_SGD, Efficiency, for_optimizer


class Push(NamedTuple):
    samples: int
    steps: int
    staleness: int
    update_samples: int
    weight: float


PLAIN = Efficiency(kappa_staleness=PLAIN_SGD[0], kappa_local=PLAIN_SGD[1], weighted=True)


@pytest.mark.parametrize(
    "spec",
    [
        "sgd",
        "sgd:lr=0.2",
        "momentum",
        "momentum:momentum=0.5",
        "momentum:lr=0.03,momentum=0.9",
        "nesterov",
        " Nesterov:lr=0.7,momentum=0.9 ",
        "delayed_nesterov:lr=0.7,momentum=0.9,period=4",
    ],
)
def test_sgd_and_its_momentum_forms_share_the_plain_model_whatever_their_options(
    spec: str,
) -> None:
    # heavy-ball and Nesterov momentum (0.5 and 0.9) were measured against plain SGD at the same
    # lr / (1 - momentum): no cost per unit of staleness or weight beyond plain SGD's
    assert for_optimizer(spec) == PLAIN


@pytest.mark.parametrize("spec", ["adam", "adamw:lr=0.001", "ADAM:b1=0"])
def test_adaptive_optimizers_get_adams_model(spec: str) -> None:
    assert for_optimizer(spec) == Efficiency(
        kappa_staleness=ADAM[0], kappa_local=ADAM[1], batch_exponent=ADAM[2], weighted=True
    )


@pytest.mark.parametrize("spec", [None, "", "lbfgs", ":momentum=0.9"])
def test_an_unknown_or_missing_optimizer_keeps_the_guesses(spec: str | None) -> None:
    assert for_optimizer(spec) == Efficiency()


def test_under_plain_sgd_a_push_counts_by_its_weight_and_staleness_barely_costs() -> None:
    fresh = PLAIN.worth(Push(32, 1, 0, 128, 1.0))
    assert fresh == pytest.approx(32.0)
    # ashl's fast worker, applied at twice an even share, counts twice
    assert PLAIN.worth(Push(32, 1, 0, 128, 2.0)) == pytest.approx(2 * fresh)
    # asp's staleness (3-5 versions) and a delta of 15 local steps lose a few per cent, no more
    assert 0.9 * fresh < PLAIN.worth(Push(32, 1, 5, 32, 1.0)) < fresh
    delta = PLAIN.worth(Push(32 * 15, 15, 3, 32 * 15 * 4, 1.0))
    assert 0.9 * 15 * fresh < delta < 15 * fresh
    # and the guessed defaults charge both far more
    guess = Efficiency()
    assert guess.worth(Push(32, 1, 5, 32, 1.0)) < 0.7 * fresh
