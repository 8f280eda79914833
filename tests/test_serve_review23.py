"""`draftsmith serve` under review, round twenty-three, through the real `openai` client. Fixed
here: a text completion of more prompts than the server's --max-batch holds (n = 1) is refused
naming `prompt`, not `n`, which the client never set, and the refusal says how many prompts fit."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from test_serve import LIMITS, engine, tiny_dir  # noqa: E402
from test_serve_review13 import srv  # noqa: E402

__all__ = ["engine", "srv", "tiny_dir"]  # fixtures
MOST = LIMITS["max_batch"]


@pytest.mark.parametrize(("prompts", "n", "param", "fit"), [
    (MOST + 1, 1, "prompt", MOST),  # the prompts alone overflow: n was never set
    (MOST // 2 + 1, 2, "n", MOST // 2),
])
def test_too_many_prompts_names_the_field_and_how_many_fit(srv: dict, prompts: int, n: int,
                                                           param: str, fit: int) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        srv["client"].completions.create(model=srv["model"], prompt=["hi"] * prompts, n=n,
                                         max_tokens=2, temperature=0)
    err = e.value.body
    assert (err["param"], err["code"]) == (param, "invalid_value")
    assert err["message"] == (f"{prompts} prompts x n={n} exceeds the server's --max-batch "
                              f"{MOST}: send at most {fit} prompts with n={n} a request")


def test_as_many_prompts_as_the_batch_holds_are_answered(srv: dict) -> None:
    r = srv["client"].completions.create(model=srv["model"], prompt=["hi"] * MOST,
                                         max_tokens=2, temperature=0)
    assert [c.index for c in r.choices] == list(range(MOST))
