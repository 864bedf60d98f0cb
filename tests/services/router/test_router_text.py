from router_fakes import ByteTokenizer

from flashpd.engine.detokenizer import TextStream


def feed(stream, text):
    return [stream.push(b) for b in text.encode("utf-8")]


def test_multibyte_characters_are_released_whole():
    stream = TextStream(ByteTokenizer())
    pieces = feed(stream, "aé€")
    assert pieces == ["a", "", "é", "", "", "€"]


def test_stop_string_never_leaks_and_cuts_before_it():
    stream = TextStream(ByteTokenizer(), stop=("END",))
    pieces = feed(stream, "abEN")
    assert "".join(pieces) == "ab" and not stream.stopped  # "EN" held back
    assert stream.push(ord("D")) == "" and stream.stopped


def test_held_back_text_is_released_when_the_stop_does_not_complete():
    stream = TextStream(ByteTokenizer(), stop=("END",))
    assert "".join(feed(stream, "xEN")) == "x"
    assert stream.push(ord("x")) == "ENx"


def test_flush_releases_the_held_tail():
    stream = TextStream(ByteTokenizer(), stop=("END",))
    feed(stream, "okE")
    assert stream.flush() == "E"


def test_earliest_of_several_stop_strings_wins():
    stream = TextStream(ByteTokenizer(), stop=("cd", "bcd"))
    assert "".join(feed(stream, "abcd")) == "a" and stream.stopped


def test_served_tokenizer_never_shows_special_tokens():
    from tokenizers import Tokenizer as HFTokenizerFile

    from flashpd.model.presets import tokenizer_path
    from flashpd.services.router.deployment import HFTokenizer

    tok = HFTokenizer(HFTokenizerFile.from_file(tokenizer_path("tiny")))
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}]) + tok.encode("yo")
    stream = TextStream(tok)
    text = "".join(stream.push(t) for t in ids) + stream.flush()
    assert "<|" not in text and tok.decode(ids) == text == "hiyo"
