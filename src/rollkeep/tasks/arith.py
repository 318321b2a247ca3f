"""The built-in task: integer addition, e.g. "37+45=" → "82".

Small enough that a tiny GPT learns it on a laptop CPU in minutes, hard enough that the
learning curve is visible. Rows are generated from a seed, so no download is needed.
"""

from __future__ import annotations

import re

import numpy as np

TASK = "arith"
TASK_PARTIAL = "arith_partial"  # the same problems, rewarded with partial credit
_NUMBER = re.compile(r"-?\d+")


def make_rows(n_rows: int, *, digits: int, seed: int, task: str = TASK) -> list[dict]:
    """`n_rows` problems with operands of up to `digits` digits, rewarded by `task`."""
    rng = np.random.default_rng([seed, 0xA217])
    hi = 10**digits
    a = rng.integers(0, hi, n_rows)
    b = rng.integers(0, hi, n_rows)
    return [
        {"prompt": f"{int(x)}+{int(y)}=", "answer": str(int(x) + int(y)), "task": task}
        for x, y in zip(a, b, strict=True)
    ]


def reward(text: str, row: dict, *, partial_credit: bool = False) -> float:
    """1.0 if the first number in the completion equals the answer, else 0.0.

    With `partial_credit`, a wrong number earns the fraction of answer digits it has in
    the right place (aligned from the right), scaled by 0.5.
    """
    m = _NUMBER.search(text)
    answer = str(row["answer"])
    if m is None:
        return 0.0
    got = m.group(0)
    if got == answer:
        return 1.0
    if not partial_credit:
        return 0.0
    same = sum(1 for x, y in zip(reversed(got), reversed(answer), strict=False) if x == y)
    return 0.5 * same / max(len(answer), len(got))
