"""An explanation from a newer server: a reason code this jobtier does not know is read, not
refused (core/explanation.py ReasonCode), so that a client older than its server still
explains a job."""

from __future__ import annotations

import msgspec
import pytest

from jobtier.core.explanation import ReasonCode, explanation_decoder


def explanation(code: str) -> bytes:
    return msgspec.json.encode(
        {
            "id": "j1",
            "state": "queued",
            "waiting": True,
            "reasons": [
                {"code": code, "message": "held for a reason from the future", "queue": "q"},
                {"code": "in_line", "message": "2 ahead", "queue": "q", "ahead": 2},
            ],
            "position": 3,
            "checked_at": "2026-12-07T10:00:00.000Z",
        }
    )


def test_an_unknown_reason_code_is_kept_as_it_came() -> None:
    e = explanation_decoder.decode(explanation("held_by_the_moon"))
    first, second = e.reasons
    assert first.code == "held_by_the_moon" and isinstance(first.code, ReasonCode)
    assert first.message == "held for a reason from the future" and first.queue == "q"
    assert first.code not in list(ReasonCode)  # not added to the known codes
    assert second.code is ReasonCode.IN_LINE and second.ahead == 2
    # and written back as it came (the CLI's --json, a proxy passing it on)
    assert msgspec.json.decode(msgspec.json.encode(first))["code"] == "held_by_the_moon"


def test_known_codes_are_still_the_members() -> None:
    assert explanation_decoder.decode(explanation("expired")).reasons[0].code is (
        ReasonCode.EXPIRED
    )


def test_a_code_that_is_not_a_string_is_still_refused() -> None:
    bad = msgspec.json.encode(
        {"id": "j", "state": "queued", "waiting": True, "position": None,
         "checked_at": "x", "reasons": [{"code": 7, "message": "m"}]}
    )  # fmt: skip
    with pytest.raises(msgspec.ValidationError, match=r"reasons\[0\]\.code"):
        explanation_decoder.decode(bad)
