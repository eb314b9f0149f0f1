"""Hostile keys: chosen collisions do not lengthen probes (the hash is seeded
per process), and the probe-length diagnostic itself is honest."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

COLLIDING = 800


def _keys_colliding_under_an_unseeded_hash(n: int) -> list[str]:
    """Keys whose CPython str hash, with the hash seed fixed at 0 (what an
    attacker can compute offline), agrees in the low 12 bits."""
    program = (
        "found = []\n"
        "i = 0\n"
        f"while len(found) < {n}:\n"
        "    k = f'user-{i}'\n"
        "    if hash(k) & 0xFFF == 0:\n"
        "        found.append(k)\n"
        "    i += 1\n"
        "print('\\n'.join(found))\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="0")
    out = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


@pytest.fixture(scope="module")
def colliding_keys() -> list[str]:
    keys = _keys_colliding_under_an_unseeded_hash(COLLIDING)
    assert len(set(keys)) == COLLIDING
    return keys


@pytest.mark.native
def test_unseeded_collisions_do_not_lengthen_probes(native, colliding_keys) -> None:
    storage = native.InMemoryStorage(stripes=1)
    limiter = native.FixedWindowCounter(5, 60.0, storage, rule="hostile")
    limiter.allow_many(colliding_keys)
    longest, mean = storage._probe_lengths()
    assert len(storage) == COLLIDING
    # Linear probing at this load has runs of a few dozen slots by chance
    # (random keys give 40-80 here); keys colliding in our hash would give
    # a run of COLLIDING. The mean stays near the random-key mean (~2).
    assert longest < COLLIDING // 10, longest
    assert mean < 3.5, mean


@pytest.mark.native
def test_probe_lengths_sees_real_collisions(native, colliding_keys) -> None:
    """The same keys with the hash forced to collide: the diagnostic must
    report the long run (so the test above would catch a weak hash)."""
    storage = native.InMemoryStorage(stripes=1, _hash_mask=0xFFFF_FFFF_0000_0000)
    limiter = native.FixedWindowCounter(5, 60.0, storage, rule="hostile")
    limiter.allow_many(colliding_keys[:300])
    longest, mean = storage._probe_lengths()
    assert longest == 300
    assert mean == pytest.approx(150.5)
