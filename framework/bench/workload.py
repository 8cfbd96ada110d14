"""Workload generator of the scheduler A/B harness: ``--workload SPEC`` -> a :class:`Trace`.

``SPEC = ARRIVAL ":" key=value ("," key=value)*``. Commas inside parentheses belong to the value.

Arrival processes (``rate`` in requests/s):

* ``poisson`` — exponential inter-arrival gaps, mean ``1/rate`` (``rate=inf``: all at t=0);
* ``gamma`` — gamma gaps with shape ``burstiness`` and mean ``1/rate`` (vLLM's ``--burstiness``;
  < 1 burstier, 1 = poisson, > 1 more regular);
* ``constant`` — a request every ``1/rate`` s;
* ``burst`` — every request at t=0 (an offline batch).

Keys (defaults in brackets):

* ``n`` [100] — number of requests;
* ``rate`` [1.0], ``burstiness`` [1.0] — see above;
* ``prompt`` [``uniform(32,512)``] — tokens of each request's OWN prompt part; a request in a prefix
  group gets ``prompt_len = prefix_len + prompt``;
* ``output`` [``uniform(16,128)``] — output tokens;
* ``prefix_groups`` [0] — number of shared-prefix groups (0 = none); each request joins a group
  uniformly at random with probability ``prefix_frac`` [1.0];
* ``prefix_len`` [256] — tokens of each group's shared prefix;
* ``priority`` [0] — distribution of priorities;
* ``seed`` [0] — seeds every draw and the synthesized token ids.

Distributions (integers, rounded half to even; lengths are clipped to >= 1):

* ``N`` — a constant, e.g. ``output=64``;
* ``uniform(a,b)`` — integers a..b inclusive;
* ``normal(mean,std)``;
* ``lognormal(median,sigma)`` — ``median * exp(sigma * N(0,1))`` (heavy-tailed lengths);
* ``choice(d1,d2,...)`` — one of the sub-distributions, uniformly; ``choice(d1:w1,d2:w2)`` weighted.
  E.g. few long and many short prompts: ``prompt=choice(uniform(8,24):9,uniform(400,480):1)``.

Example::

    poisson:rate=4,n=200,prompt=uniform(32,512),output=uniform(16,128),prefix_groups=4,prefix_len=256,priority=uniform(0,3),seed=0

Every draw uses its own ``numpy.random.default_rng([seed, stream])`` stream, so a spec and a seed
always give the same trace on every machine (numpy's PCG64 is platform independent).
"""
from __future__ import annotations

import math
import re
from typing import Callable

import numpy as np

from kvforge.bench.trace import Trace, TraceRequest

# -- distributions -------------------------------------------------------------------------
Sampler = Callable[[np.random.Generator, int], np.ndarray]


class _Parser:
    """Recursive-descent parser for the distribution mini-language (module docstring)."""

    _TOKEN = re.compile(r"\s*(?:(?P<num>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|inf)|(?P<name>[a-z_]+)|(?P<p>[(),:]))")

    def __init__(self, text: str) -> None:
        self.text = text
        self.toks: list[tuple[str, str]] = []
        pos = 0
        text = text.strip()
        while pos < len(text):
            m = self._TOKEN.match(text, pos)
            if not m or m.end() == pos:
                raise ValueError(f"cannot parse distribution {self.text!r} at {text[pos:]!r}")
            kind = m.lastgroup
            self.toks.append((kind, m.group(kind)))
            pos = m.end()
        self.i = 0

    def _peek(self) -> tuple[str, str] | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def _take(self, value: str | None = None) -> tuple[str, str]:
        t = self._peek()
        if t is None or (value is not None and t[1] != value):
            raise ValueError(f"distribution {self.text!r}: expected {value or 'more'}")
        self.i += 1
        return t

    def parse(self) -> Sampler:
        s = self._dist()
        if self._peek() is not None:
            raise ValueError(f"distribution {self.text!r}: unexpected {self._peek()[1]!r}")
        return s

    def _number(self) -> float:
        kind, v = self._take()
        if kind != "num":
            raise ValueError(f"distribution {self.text!r}: expected a number, got {v!r}")
        return float(v)

    def _dist(self) -> Sampler:
        kind, v = self._take()
        if kind == "num":
            c = float(v)
            return lambda rng, n: np.full(n, c)
        if kind != "name":
            raise ValueError(f"distribution {self.text!r}: unexpected {v!r}")
        self._take("(")
        if v == "choice":
            subs, weights = [], []
            while True:
                subs.append(self._dist())
                weights.append(1.0)
                if self._peek() == ("p", ":"):
                    self._take(":")
                    weights[-1] = self._number()
                if self._peek() == ("p", ","):
                    self._take(",")
                    continue
                break
            self._take(")")
            w = np.asarray(weights, dtype=np.float64)
            if (w < 0).any() or w.sum() <= 0:
                raise ValueError(f"distribution {self.text!r}: choice weights must be >= 0 and not all 0")
            w = w / w.sum()

            def choice(rng: np.random.Generator, n: int) -> np.ndarray:
                pick = rng.choice(len(subs), size=n, p=w)
                out = np.empty(n)
                for j, s in enumerate(subs):
                    idx = np.nonzero(pick == j)[0]
                    out[idx] = s(rng, len(idx))
                return out
            return choice
        args = [self._number()]
        while self._peek() == ("p", ","):
            self._take(",")
            args.append(self._number())
        self._take(")")
        return _named(v, args, self.text)


def _named(name: str, args: list[float], text: str) -> Sampler:
    want = {"const": 1, "uniform": 2, "normal": 2, "lognormal": 2}
    if name not in want:
        raise ValueError(f"distribution {text!r}: unknown {name!r}; use a number, "
                         "uniform(a,b), normal(mean,std), lognormal(median,sigma) or choice(...)")
    if len(args) != want[name]:
        raise ValueError(f"distribution {text!r}: {name} takes {want[name]} arguments, got {len(args)}")
    if name == "const":
        return lambda rng, n: np.full(n, args[0])
    if name == "uniform":
        lo, hi = args
        if hi < lo:
            raise ValueError(f"distribution {text!r}: uniform(a,b) needs a <= b")
        return lambda rng, n: rng.integers(int(lo), int(hi), size=n, endpoint=True).astype(np.float64)
    if name == "normal":
        mean, std = args
        return lambda rng, n: rng.normal(mean, std, size=n)
    median, sigma = args
    return lambda rng, n: median * np.exp(sigma * rng.standard_normal(n))


def parse_distribution(text: str) -> Sampler:
    """Parse one distribution (module docstring); returns ``sample(rng, n) -> float64 [n]``.

    Raises:
        ValueError: naming the bad part of ``text``.
    """
    return _Parser(str(text)).parse()


# -- workloads -----------------------------------------------------------------------------
ARRIVALS = ("poisson", "gamma", "constant", "burst")
_DEFAULTS = {"n": "100", "rate": "1.0", "burstiness": "1.0", "prompt": "uniform(32,512)",
             "output": "uniform(16,128)", "prefix_groups": "0", "prefix_len": "256", "prefix_frac": "1.0",
             "priority": "0", "seed": "0"}
# Fixed stream ids: adding a key never changes the draws of another.
_STREAMS = {"arrival": 1, "prompt": 2, "output": 3, "group": 4, "group_member": 5, "priority": 6}


def split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split ``text`` on ``sep`` outside parentheses."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise ValueError(f"unbalanced parentheses in {text!r}")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def parse_workload(spec: str) -> tuple[str, dict[str, str]]:
    """``"poisson:rate=4,n=10"`` -> ``("poisson", {...all keys with defaults...})``.

    Raises:
        ValueError: unknown arrival process or key, or a malformed pair.
    """
    kind, _, rest = spec.partition(":")
    kind = kind.strip()
    if kind not in ARRIVALS:
        raise ValueError(f"--workload {spec!r}: unknown arrival process {kind!r}; use one of {', '.join(ARRIVALS)}")
    params = dict(_DEFAULTS)
    for pair in split_top_level(rest):
        key, eq, value = pair.partition("=")
        key = key.strip()
        if not eq or not value.strip():
            raise ValueError(f"--workload {spec!r}: expected key=value, got {pair!r}")
        if key not in _DEFAULTS:
            raise ValueError(f"--workload {spec!r}: unknown key {key!r}; known: {', '.join(sorted(_DEFAULTS))}")
        params[key] = value.strip()
    return kind, params


def _int_param(params: dict[str, str], key: str, lo: int) -> int:
    try:
        v = int(params[key])
    except ValueError:
        raise ValueError(f"--workload: {key} must be an integer, got {params[key]!r}") from None
    if v < lo:
        raise ValueError(f"--workload: {key} must be >= {lo}, got {v}")
    return v


def generate_trace(spec: str) -> Trace:
    """Generate a trace from a workload spec (module docstring); deterministic for a spec.

    Raises:
        ValueError: a bad spec, naming the key.
    """
    kind, p = parse_workload(spec)
    n = _int_param(p, "n", 1)
    seed = _int_param(p, "seed", 0)
    groups = _int_param(p, "prefix_groups", 0)
    prefix_len = _int_param(p, "prefix_len", 0) if groups else 0
    try:
        rate, burst, frac = float(p["rate"]), float(p["burstiness"]), float(p["prefix_frac"])
    except ValueError as e:
        raise ValueError(f"--workload {spec!r}: {e}") from None
    if not rate > 0 or not burst > 0 or not 0 <= frac <= 1:
        raise ValueError(f"--workload {spec!r}: need rate > 0, burstiness > 0 and 0 <= prefix_frac <= 1")

    def rng(stream: str) -> np.random.Generator:
        return np.random.default_rng([seed, _STREAMS[stream]])

    if kind == "burst" or math.isinf(rate):
        arrivals = np.zeros(n)
    elif kind == "constant":
        arrivals = np.arange(n) / rate
    else:
        shape = 1.0 if kind == "poisson" else burst
        gaps = rng("arrival").gamma(shape, 1.0 / (rate * shape), size=n)
        gaps[0] = 0.0  # the first request opens the replay
        arrivals = np.cumsum(gaps)
    own = np.maximum(1, np.rint(parse_distribution(p["prompt"])(rng("prompt"), n))).astype(np.int64)
    out = np.maximum(1, np.rint(parse_distribution(p["output"])(rng("output"), n))).astype(np.int64)
    prio = np.rint(parse_distribution(p["priority"])(rng("priority"), n)).astype(np.int64)
    if groups:
        member = rng("group_member").random(n) < frac
        gid = rng("group").integers(0, groups, size=n)
    reqs = []
    for i in range(n):
        g = int(gid[i]) if groups and member[i] else None
        plen = prefix_len if g is not None else 0
        reqs.append(TraceRequest(arrival_time=float(arrivals[i]), prompt_len=int(own[i]) + plen,
                                 output_len=int(out[i]), prefix_group=g, prefix_len=plen, priority=int(prio[i])))
    return Trace(requests=reqs, seed=seed, workload=spec)
