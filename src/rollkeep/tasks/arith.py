"""The built-in task: integer addition, e.g. "37+45=" → "82".

Small enough that a tiny GPT learns it on a laptop CPU in minutes, hard enough that the
learning curve is visible. Rows are generated from a seed, so no download is needed.
"""

from __future__ import annotations

import re

import numpy as np

from .held_out import distinct_pairs

TASK = "arith"
TASK_PARTIAL = "arith_partial"  # the same problems, rewarded with partial credit
_NUMBER = re.compile(r"-?\d+")


FORMATS = ("plain", "padded", "reversed")


def problem(a: int, b: int, *, digits: int, fmt: str = "plain", task: str = TASK) -> dict:
    """The row of problem a + b written in `fmt` (config `data.generated.format`):

        plain     "7+45="  -> "52"
        padded    "07+45=" -> "052"   operands to `digits` digits, the answer to digits + 1
        reversed  "07+45=" -> "250"   padded, the answer least significant digit first
    """
    if fmt == "plain":
        return {"prompt": f"{a}+{b}=", "answer": str(a + b), "task": task}
    answer = f"{a + b:0{digits + 1}d}"
    if fmt == "reversed":
        answer = answer[::-1]
    elif fmt != "padded":
        raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
    return {"prompt": f"{a:0{digits}d}+{b:0{digits}d}=", "answer": answer, "task": task}


def operands(row: dict) -> tuple[int, int]:
    """(a, b) of a row written in any format."""
    a, b = row["prompt"].rstrip("=").split("+")
    return int(a), int(b)


def make_rows(
    n_rows: int, *, digits: int, seed: int, task: str = TASK, fmt: str = "plain"
) -> list[dict]:
    """`n_rows` problems with operands of up to `digits` digits, rewarded by `task`."""
    rng = np.random.default_rng([seed, 0xA217])
    hi = 10**digits
    a = rng.integers(0, hi, n_rows)
    b = rng.integers(0, hi, n_rows)
    return [problem(int(x), int(y), digits=digits, fmt=fmt, task=task) for x, y in zip(a, b, strict=True)]


def held_out_rows(
    n_rows: int, *, digits: int, seed: int, exclude: list[dict], task: str = TASK, fmt: str = "plain"
) -> list[dict]:
    """`n_rows` distinct problems, none of which is the problem of a row of `exclude` (the
    training rows): an evaluation set the policy was never trained or warm-started on.
    Drawn from their own seeded stream, so they do not depend on the training rows'
    stream, only on which problems those rows hold. Raises ValueError when fewer than
    `n_rows` problems with operands of up to `digits` digits are left."""
    hi = 10**digits
    seen = {operands(r) for r in exclude}
    left = hi * hi - len(seen)
    if n_rows > left:
        raise ValueError(f"only {left} problems with operands of up to {digits} digit(s) are "
                         f"not in the training rows; {n_rows} held-out rows were asked for")
    pairs = distinct_pairs(np.random.default_rng([seed, 0xE7A1]), 0, hi, n_rows, seen)
    return [problem(x, y, digits=digits, fmt=fmt, task=task) for x, y in pairs]


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
