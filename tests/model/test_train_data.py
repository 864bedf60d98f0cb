"""ShareGPT parsing and the held-out split (flashpd.model.train_data)."""

from __future__ import annotations

import json

import pytest

from flashpd.model import train_data as td


def _record(cid, *turns):
    return {"id": cid, "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_parse_stops_at_a_record_cut_short():
    whole = [_record("a_0", ("human", "hi"), ("gpt", "hello")), _record("b_0", ("human", "x"))]
    text = json.dumps(whole)
    cut = text[: text.index('"b_0"') + 20]  # the second record is truncated
    assert td.parse_records(cut) == whole[:1]
    assert td.parse_records(text) == whole


def test_conversation_roles_and_chat_text():
    conv = td.to_conversation(
        _record(
            "a_1",
            ("system", "Be brief."),
            ("human", "Hi"),
            ("gpt", "Hello"),
            ("human", "Bye"),
            ("chatgpt", "Goodbye"),
            ("weird", "dropped"),
        )
    )
    assert conv.thread == "a"
    assert td.chat_text(conv) == (
        "<|begin_of_sentence|>Be brief.<|User|>Hi<|Assistant|>Hello"
        "<|end_of_sentence|><|User|>Bye<|Assistant|>Goodbye"
        "<|end_of_sentence|>"
    )
    messages, reply = td.prompt_and_reply(conv)
    assert [m["role"] for m in messages] == ["system", "user"] and reply == "Hello"
    assert td.to_conversation(_record("c_0", ("human", "only a question"))) is None
    assert td.to_conversation({"id": "x"}) is None


def test_split_is_by_thread_and_deterministic():
    convs = [
        td.Conversation(f"t{i}_{part}", (("user", "q"), ("assistant", "a"))) for i in range(400) for part in range(3)
    ]
    train, held = td.split(convs)
    assert 0 < len(held) < len(convs) * 0.1
    held_threads = {c.thread for c in held}
    assert not held_threads & {c.thread for c in train}  # every part of a thread on one side
    assert td.split(convs) == (train, held)


@pytest.mark.slow
def test_bundled_dataset_loads():
    convs = td.load_conversations()
    train, held = td.split(convs)
    assert len(convs) > 10000 and len(held) > 100


def _records(n: int) -> list[dict]:
    return [
        {"id": f"t{i}_0", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
        for i in range(n)
    ]


def test_subset_keeps_dataset_order_per_split_and_reads_back_as_gzip(tmp_path):
    src = tmp_path / "all.json"
    src.write_text(json.dumps(_records(400)))
    train, held = td.split(td.load_conversations(str(src)))
    assert held, "400 threads at 2% should hold some out"
    out = str(tmp_path / "sub.json.gz")
    assert td.write_subset(out, 30, 2, str(src)) == (30, 2)
    sub_train, sub_held = td.split(td.load_conversations(out))
    assert sub_train == train[:30]  # --data SUBSET --limit-conversations n == the full set's first n
    assert sub_held == held[:2]


def test_unreadable_dataset_names_the_path(tmp_path):
    bad = tmp_path / "broken.json.gz"
    bad.write_bytes(b"not gzip")
    with pytest.raises(td.DataError, match="broken.json.gz"):
        td.load_conversations(str(bad))
