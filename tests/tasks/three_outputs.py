"""A model plug-in with 3 outputs whatever the data set's classes: refused at start-up."""

from hetd.zoo.models import Model, mlp


def model(num_classes: int = 10) -> Model:
    del num_classes  # the mistake: a plug-in that ignores the data set's classes
    return mlp(3, hidden=[8])
