"""Divisors of GPU counts and batch sizes, from the prime factorisation (never trial division up to n).

Small factors are divided out by trial division up to 10,000; what is left is either 1, a prime
(Miller-Rabin with the first twelve prime bases, deterministic below 3.3 * 10**24) or split by
Pollard's rho (Brent's variant). Every count memguard factors is bounded (numbers.py), so this takes
microseconds; it stays fast for any 64-bit number.
"""
from __future__ import annotations

import math
from functools import lru_cache

_SMALL = 10_000
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


@lru_cache(maxsize=1024)
def divisors(n: int) -> tuple[int, ...]:
    """Every divisor of ``n`` >= 1, ascending."""
    if n < 1:
        raise ValueError(f"divisors of {n}: expected a positive integer")
    divs = [1]
    for p, k in sorted(prime_factors(n).items()):
        divs = [d * p**e for d in divs for e in range(k + 1)]
    return tuple(sorted(divs))


def prime_factors(n: int) -> dict[int, int]:
    """``{prime: exponent}`` of ``n`` >= 1."""
    out: dict[int, int] = {}
    for p in (2, 3):
        while n % p == 0:
            out[p] = out.get(p, 0) + 1
            n //= p
    f = 5
    while f <= _SMALL and f * f <= n:
        for p in (f, f + 2):
            while n % p == 0:
                out[p] = out.get(p, 0) + 1
                n //= p
        f += 6
    stack = [n] if n > 1 else []
    while stack:
        m = stack.pop()
        if m < _SMALL * _SMALL or _is_prime(m):   # no factor <= 10,000 left: below 10**8 it is prime
            out[m] = out.get(m, 0) + 1
            continue
        d = _pollard_brent(m)
        stack += [d, m // d]
    return out


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _pollard_brent(n: int) -> int:
    """A non-trivial factor of the composite ``n`` (Brent 1980, "An improved Monte Carlo factorization
    algorithm"); deterministic: the constants are tried in order."""
    for c in range(1, 1000):
        y, m, g, r, q = 2, 128, 1, 1, 1
        x = ys = y
        while g == 1:
            x = y
            for _ in range(r):
                y = (y * y + c) % n
            k = 0
            while k < r and g == 1:
                ys = y
                for _ in range(min(m, r - k)):
                    y = (y * y + c) % n
                    q = q * abs(x - y) % n
                g = math.gcd(q, n)
                k += m
            r *= 2
        if g == n:
            g = 1
            while g == 1:
                ys = (ys * ys + c) % n
                g = math.gcd(abs(x - ys), n)
        if g != n:
            return g
    raise ArithmeticError(f"cannot factor {n}")  # pragma: no cover - not reached for composites
