"""The seeded visit order of an epoch: `permutation(seed, epoch, n)`.

Part of the checkpoint format: the formula must never change (tests pin it).
"""

from __future__ import annotations

import numpy as np

from rollkeep.core.errors import UserInputError

__all__ = ["MAX_SEED", "permutation"]

MAX_SEED = 2**63

_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_MASK = 2**64 - 1


def _mix_int(z: int) -> int:
    """The splitmix64 finalizer on a Python int (mod 2**64)."""
    z &= _MASK
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def _mix_array(z: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer on a uint64 array; numpy array arithmetic wraps mod 2**64."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
    return z ^ (z >> np.uint64(31))


def permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The visit order of epoch `epoch`: `perm[ordinal] = idx`, int64, length `n`.

    Part of the checkpoint format, so it uses no numpy RNG (whose streams may change
    between versions). With `mix` the splitmix64 finalizer

        mix(z) = z ^= z >> 30; z *= 0xBF58476D1CE4E5B9;
                 z ^= z >> 27; z *= 0x94D049BB133111EB;
                 z ^ (z >> 31)                                  (all mod 2**64)

    and G = 0x9E3779B97F4A7C15:

        stream = mix(mix(seed) + G * (epoch + 1))
        hash_i = mix(stream + G * (i + 1))                      for i in 0..n-1
        perm   = argsort(hash, kind="stable")

    `mix` is a bijection and G is odd, so the n hashes are distinct (for n < 2**64) and
    the order has no ties; the stable sort only makes that explicit.
    """
    if not 0 <= seed < MAX_SEED:
        raise UserInputError(
            "Permutation seed out of range", expected="0 <= seed < 2**63", found=str(seed)
        )
    if epoch < 0 or n < 0:
        raise UserInputError(
            "Permutation epoch and size must be >= 0", found=f"epoch={epoch}, n={n}"
        )
    stream = _mix_int(_mix_int(seed) + _GOLDEN * (epoch + 1))
    positions = np.arange(1, n + 1, dtype=np.uint64)
    hashes = _mix_array(np.uint64(stream) + positions * np.uint64(_GOLDEN))
    return np.argsort(hashes, kind="stable").astype(np.int64, copy=False)
