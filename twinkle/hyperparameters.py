"""Upper bounds on optimizer hyper-parameters.

NaN and infinities are refused wherever numbers are parsed; these bounds refuse the finite but absurd
ones. A learning rate of 1e308 is a valid float, and one optim_step with it turns the adapter's weights
into infinities: every later result of that tenant is NaN. The bounds lie far outside any useful setting
(LoRA learning rates are around 1e-5 to 1e-3; AdamW's decay multiplies the weights by 1 - lr * decay,
which must stay within [0, 1]).
"""

from __future__ import annotations

import math

from twinkle.errors import InvalidRequest
from twinkle.types import AdamParams

MAX_LEARNING_RATE = 1.0
MAX_WEIGHT_DECAY = 1.0
MAX_EPS = 1.0


def check_adam_params(params: AdamParams, where: str = "adam_params") -> AdamParams:
    """`params`, or InvalidRequest naming every value over its bound."""
    problems = [f"{where}.{name} is {value}, not a finite number" for name, value in vars(params).items()
                if not math.isfinite(value)]
    if params.learning_rate > MAX_LEARNING_RATE:
        problems.append(f"{where}.learning_rate is {params.learning_rate:g}, over the limit of {MAX_LEARNING_RATE:g}")
    if params.weight_decay > MAX_WEIGHT_DECAY:
        problems.append(f"{where}.weight_decay is {params.weight_decay:g}, over the limit of {MAX_WEIGHT_DECAY:g}")
    if params.eps > MAX_EPS:
        problems.append(f"{where}.eps is {params.eps:g}, over the limit of {MAX_EPS:g}")
    if problems:
        raise InvalidRequest("Refused optimizer settings: " + "; ".join(problems) + ".",
                             hint="Values this large make the adapter's weights overflow to infinity and every "
                             "later result NaN; typical LoRA learning rates are 1e-5 to 1e-3.")
    return params
