"""The chaos schedule: seeded, Poisson, bounded by maxConcurrent."""

from diloco.chaos import ChaosMonkey
from diloco.spec import Chaos


def kills(chaos: Chaos, seconds: float, up: list[str], down: int = 0) -> list[tuple[float, str]]:
    monkey = ChaosMonkey.seeded(chaos, start=0.0)
    out, t = [], 0.0
    while t < seconds:
        victim = monkey.pick(t, up, down)
        if victim:
            out.append((round(t, 1), victim))
        t += 0.1
    return out


def test_seeded_and_rate_close_to_mean() -> None:
    chaos = Chaos(enabled=True, mean_seconds_between_kills=10.0, seed=3)
    a = kills(chaos, 2000, ["a", "b", "c"])
    assert a == kills(chaos, 2000, ["a", "b", "c"])  # same seed, same schedule
    assert a != kills(chaos.model_copy(update={"seed": 4}), 2000, ["a", "b", "c"])
    assert 150 <= len(a) <= 250  # ~200 expected at one kill per 10 s
    assert {v for _, v in a} == {"a", "b", "c"}


def test_disabled_and_max_concurrent() -> None:
    assert kills(Chaos(enabled=False, mean_seconds_between_kills=1.0), 100, ["a"]) == []
    chaos = Chaos(enabled=True, mean_seconds_between_kills=1.0, max_concurrent=1)
    assert kills(chaos, 100, ["a", "b"], down=1) == []
    assert kills(chaos, 100, [], down=0) == []
