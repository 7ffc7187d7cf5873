"""The responder's layout for `n` > 1 (`Responder._respond_sequences`), with the fake pb module of
test_metrics.py: one element per completion in every response, each completion's delta ("" when
it has none), its finish reason kept once it ended, one FINAL when the last one ends; without
streaming one response with the whole texts; with STREAM_INTERVAL 2 a response once a completion
has 2 tokens pending."""

from __future__ import annotations

from test_metrics import Harness, fake_pb  # noqa: F401 - the fixture

from mla_backend.request import FinishReason, RequestOutput
from mla_backend.serving.protocol import OutputOptions


def seq(index: int, text: str, total: int, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", [7] * len(text), text, finished,
                         FinishReason.LENGTH if finished else None, 5, total, 0, index=index,
                         first_token_time=1.0, last_token_time=1.0 + total)


def responses(h: Harness) -> list[tuple[list[str], list[str], int]]:
    """(texts, finish reasons, flags) of each response sent for "r"."""
    got = []
    for response, flags in h.senders["r"].responses:
        arrays = {t.name: t.array for t in response.output_tensors}
        got.append(([x.decode() for x in arrays["text_output"]],
                    [x.decode() for x in arrays["finish_reason"]], flags))
    return got


def test_streaming_gives_every_completion_in_every_response(fake_pb):  # noqa: F811
    pb, responder = fake_pb
    h = Harness(pb, responder)
    h.register("r", stream=True, n=3,
               options=OutputOptions(stream=True, return_finish_reason=True))
    h.feed(seq(0, "a", 1), seq(1, "b", 1))
    h.feed(seq(2, "c", 1), seq(0, "d", 2, finished=True))
    h.feed(seq(1, "e", 2, finished=True), seq(2, "f", 2, finished=True))
    h.wait_final("r")
    h.stop()
    assert responses(h) == [
        (["a", "b", ""], ["None", "None", "None"], 0),
        (["d", "", "c"], ["length", "None", "None"], 0),
        (["", "e", "f"], ["length", "length", "length"], 1),
    ]


def test_non_streaming_gets_one_response_with_the_whole_texts(fake_pb):  # noqa: F811
    pb, responder = fake_pb
    h = Harness(pb, responder)
    h.register("r", stream=False, n=2, options=OutputOptions(return_finish_reason=True))
    h.feed(seq(1, "xy", 2, finished=True))
    h.feed(seq(0, "pqr", 3, finished=True))
    h.wait_final("r")
    h.stop()
    assert responses(h) == [(["pqr", "xy"], ["length", "length"], 1)]


def test_stream_interval_holds_until_a_completion_has_enough(fake_pb):  # noqa: F811
    pb, responder = fake_pb
    h = Harness(pb, responder, stream_interval=2)
    h.register("r", stream=True, n=2,
               options=OutputOptions(stream=True, return_finish_reason=True))
    h.feed(seq(0, "a", 1), seq(1, "b", 1))  # the first response goes out at once
    h.feed(seq(0, "c", 2))  # held: 1 token pending
    h.feed(seq(1, "d", 2))  # held: 1 each
    h.feed(seq(0, "e", 3))  # completion 0 has 2 pending: sent
    h.feed(seq(1, "f", 3, finished=True), seq(0, "g", 4, finished=True))
    h.wait_final("r")
    h.stop()
    assert [r[0] for r in responses(h)] == [["a", "b"], ["ce", "d"], ["g", "f"]]
    assert [r[2] for r in responses(h)] == [0, 0, 1]
